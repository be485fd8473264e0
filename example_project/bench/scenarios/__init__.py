"""The shipped scenarios, one module each; each defines ``SCENARIO``."""
