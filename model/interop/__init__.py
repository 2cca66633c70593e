"""Doors to other tools: Hugging Face model folders in (``hf_import``)."""
