"""The replay-only mitigations: each declared once, the values they take, their named sets, their settings in the
trainers' own configuration and the catalogue generated from them."""
