"""Graph passes: each is a function Graph -> Graph that returns a new graph and leaves its input alone.
`pipeline.py` holds the ordered lists of passes and the runner that keeps the books."""
