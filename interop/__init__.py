"""Doors into and out of ordinal: Hugging Face folders in, other engines' formats out.

``hf_import`` turns a GPT-2- or Llama-family Hugging Face folder into a checkpoint (safetensors
read directly). ``hf_export`` writes a Hugging Face folder (a native architecture where one
computes exactly what ordinal computes, else the self-contained port in ``remote/``, loaded with
``trust_remote_code=True``); ``gguf_export`` writes a GGUF file for llama.cpp. None of them
imports ``transformers``: the formats are read and written directly, so both run on ordinal's own
dependencies (plus ``gguf`` for GGUF).
"""
