"""fastattn inside other libraries, one module each:

- :mod:`fastattn.integrations.hf`: Hugging Face transformers (the ``"fastattn"`` attention
  implementation, per-family swapping of norms, MLPs and rotary embeddings);
- :mod:`fastattn.integrations.megatron`: Megatron-LM / Apex fused-softmax entry points.

The older paths ``fastattn.hf`` and ``fastattn.compat.megatron`` name the same modules.
"""
