"""ordinal's model package: config → transformer (with a positional scheme) → sampling.

Empty on purpose: importing one module (``model.tokenizer``, ``model.sampling_params``) loads
that module alone, so the API process, which holds no weights, never imports torch.
"""
