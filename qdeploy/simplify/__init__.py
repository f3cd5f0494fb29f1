"""Graph passes: each is a function Graph -> Graph that returns a new graph and leaves its input alone.
`pipeline.py` holds the import-time pass list (the lowering owns its own) and the runner that keeps the books."""
