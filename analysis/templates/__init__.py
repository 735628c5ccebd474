"""Jinja2 templates of the HTML and Markdown reports."""
