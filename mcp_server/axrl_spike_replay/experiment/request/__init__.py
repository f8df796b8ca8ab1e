"""The replay request as the engine and both faces read it: its parts, each field declared once."""
