"""A sibling module with the same name as identity_bytes' helpers.py, and different content."""

NAME = "auto_complete"
SCALE = 2
