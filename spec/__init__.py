"""The normative spec: markdown chapters, and the clause registry parsed from them."""
