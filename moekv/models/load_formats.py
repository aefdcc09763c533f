"""The weight sources load_model accepts, in a module that imports nothing, so that the
configuration can check a name without importing the loader."""

LOAD_FORMATS = ("auto", "safetensors", "dummy")
