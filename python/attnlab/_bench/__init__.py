"""The benchmark behind ``python -m attnlab bench``."""
