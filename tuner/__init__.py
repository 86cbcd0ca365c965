"""dynspec-tuner: learns per batch-size bucket how many draft steps pay, and tells SGLang.

Kept import-light on purpose: the SGLang plugin imports ``tuner.plugin`` in every server
process.
"""

__version__ = "0.1.0"
