"""Shared plumbing for the five method files: models, retrieval, metrics, data, the toy world.

Nothing here knows about any method; see DESIGN notes in README.md ("Layout").
"""
