"""The notebook face: magics (and later widgets). The only layer that imports IPython."""

__all__: list[str] = []
