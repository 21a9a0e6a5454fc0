"""The ``topology`` tool: a multi-module topology from a JSON spec (text, JSON, SVG)."""
