"""Triton kernels of the triton attention backend (SGLang: layers/attention/triton_ops/).

- ``extend_attention_fwd``: new rows attend to their cached prefix (read through
  ``req_to_token``) and, causally, to the new rows before them.
- ``decode_attention_fwd``: one row per request over its whole cache, split-KV
  (flash-decoding): stage 1 attends per split, stage 2 merges the splits.
- ``store_kv_cache``: writes the new rows' K/V into their ``out_cache_loc`` slots.
"""
