"""The files an exported custom-code folder carries (``configuration_ordinal.py``,
``modeling_ordinal.py``): copied verbatim next to its weights, so they import only torch and
transformers, never ordinal."""
