"""Doors out of ordinal: a checkpoint written in the formats other engines load.

``hf_export`` writes a Hugging Face folder (a native architecture where one computes exactly what
ordinal computes, else the self-contained port in ``remote/``, loaded with
``trust_remote_code=True``); ``gguf_export`` writes a GGUF file for llama.cpp. Neither imports
``transformers``: the formats are written directly, so the export runs on ordinal's own
dependencies (plus ``gguf`` for GGUF).
"""
