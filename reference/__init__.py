"""The executable reference model: the spec's oracle. Written for clarity, not speed."""
