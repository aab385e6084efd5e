"""Small tokenizers of the new families, trained here with HF `tokenizers` (the hub is out of reach) and
wrapped in transformers' own tokenizer classes, so their tokenizer.json is laid out as the real ones are."""
from __future__ import annotations

import json
import random
from pathlib import Path

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
WORDS = ["the", "model", "thinks", "über", "naïve", "日本語", "数据", "emoji😀", "don't", "it's", "12345", "3.14",
         "  ", "\n", "\n\n", "\t", "café", "Привет", "mixture", "experts", "<tag>", "x=y+1;", "THE", "Hello", "world",
         "ﬁ", "e\u0301", "   indented", "\r\n", "$$", "😀😀", "Sum", "small", "numbers", "Four"]


def generated_texts(seed: int = 0, n: int = 200) -> list[str]:
    """Random sentences over WORDS: scripts, digits, punctuation, runs of spaces and newlines, combining marks."""
    rng = random.Random(seed)
    joiners = [" ", "", "  ", "\n"]
    return ["".join(rng.choice(WORDS) + rng.choice(joiners) for _ in range(rng.randint(1, 12))) for _ in range(n)]


def _trained(tokenizer, vocab_size: int, **trainer_args) -> tuple[dict, list]:
    from tokenizers import trainers
    tokenizer.train_from_iterator(generated_texts(seed=1, n=400),
                                  trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, **trainer_args))
    model = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return model["vocab"], merges


def qwen_tokenizer(path: Path):
    """A Qwen2/Qwen3-style byte-level BPE (transformers' Qwen2Tokenizer: NFC, Qwen's split regex, ByteLevel)
    with Qwen3's chat tokens and chat template, saved to `path`."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
    t = Tokenizer(models.BPE())
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), "isolated"),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    vocab, merges = _trained(t, 600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|endoftext|>": 0} | {piece: i + 1 for piece, i in vocab.items()}
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tok.chat_template = (TEMPLATES / "qwen3.jinja").read_text()
    tok.save_pretrained(path)
    return tok


def gemma_tokenizer(path: Path):
    """A Gemma-style SentencePiece BPE (transformers' GemmaTokenizer: spaces as ▁, no dummy prefix, byte
    fallback to <0xNN>) with Gemma 3's turn tokens and chat template, saved to `path`."""
    from tokenizers import Tokenizer, models, normalizers
    from transformers import GemmaTokenizer
    t = Tokenizer(models.BPE())
    t.normalizer = normalizers.Replace(" ", "▁")
    pieces, merges = _trained(t, 500, limit_alphabet=60)              # rare characters left to byte fallback
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    vocab = {s: i for i, s in enumerate(specials)}
    vocab |= {f"<0x{b:02X}>": len(specials) + b for b in range(256)}
    for piece in sorted(pieces, key=pieces.get):
        vocab.setdefault(piece, len(vocab))
    tok = GemmaTokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = (TEMPLATES / "gemma3.jinja").read_text()
    tok.save_pretrained(path)
    return tok


def sentencepiece_model(folder: Path, vocab_size: int = 600) -> Path:
    """A small SentencePiece BPE `tokenizer.model` (byte fallback) in `folder`: what llama.cpp's converter reads
    for Qwen3 and Gemma 3 when it is there (for our own trained byte-level BPE it would know no pre-tokenizer hash)."""
    import io
    import sentencepiece
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(generated_texts(seed=1, n=400)), model_writer=model, model_type="bpe",
        vocab_size=vocab_size, byte_fallback=True, character_coverage=0.98, add_dummy_prefix=False,
        hard_vocab_limit=False, minloglevel=2)
    path = Path(folder) / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return path
