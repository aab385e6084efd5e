"""Checkpoints: how weights and tokenizers get from files into the model's arrays, and back.

safetensors folders in HF layout (`weights`), GGUF (`gguf_import`), fetching (`pull`), the tokenizer
and its files and chat templates, and the conversions that rewrite a checkpoint (quantizing, folding
FlashNorm's gains, fewer KV heads, GQA -> MLA). It may import `minillm.model`; nothing here runs
a model over many sequences or serves one.
"""
