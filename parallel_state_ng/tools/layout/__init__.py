"""The ``layout`` tool: process groups, one rank's view, node locality, SVG, communicators."""
