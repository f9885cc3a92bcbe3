"""Tokenizer backends, chat templates and the incremental detokenizer, on tokenizers trained here."""

import json
import random
import re
import shutil

import pytest
import sentencepiece as spm
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from prefixkv.tokenizer import (FALLBACK_CHAT_TEMPLATE, HFTokenizer, IncrementalDetokenizer,
                                SentencePieceTokenizer, Tokenizer)

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Hello world, this is a small corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "Streaming detokenization must never emit a broken character.",
    "héllo café naïve résumé",
    "你好，世界！今天天气很好。我们一起学习。",
    "模型生成的文本需要逐个词元输出。",
    "emoji 🌍🚀🎉 and more 🌍 text 🚀",
] * 20
MIXED_TEXTS = [
    "你好，世界 🌍🚀 héllo",
    "Hello world",
    "naïve 模型 🎉🎉 done.",
    "零宽\u200d👩\u200d💻 family 👨\u200d👩\u200d👧",
    "tabs\tand\nnewlines\n\n  spaced  out ",
]
BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=BPE_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>")
    hf.add_tokens(["<|tool|>"])  # an added, non-special token: counts in vocab_size
    hf.chat_template = CHATML
    path = tmp_path_factory.mktemp("bpe")
    hf.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return path


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sp")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in CORPUS if line.isascii()]),  # CJK and emoji: byte fallback
        model_prefix=str(path / "tokenizer"), vocab_size=360, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, hard_vocab_limit=False,
        minloglevel=2)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A Llama-2 style tokenizer.json: "▁" normalizer, byte fallback, ByteFallback/Fuse/Strip decoder, no template."""
    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.train_from_iterator([line for line in CORPUS if line.isascii()],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    vocab = raw.get_vocab()
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    merges = [tuple(m) for m in json.loads(raw.to_str())["model"]["merges"]]
    raw.model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama(llama_dir):
    return Tokenizer.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def bpe(bpe_dir):
    return Tokenizer.from_pretrained(bpe_dir)


@pytest.fixture(scope="module")
def sp(sp_dir):
    return Tokenizer.from_pretrained(sp_dir)


@pytest.fixture(params=["bpe", "sp", "llama"])
def tok(request):
    return request.getfixturevalue(request.param)


def stream(tok, ids, skip_special_tokens=True):
    """Feed ids one by one; check each step's emitted text against the prefix decode."""
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[1, 2, 3], skip_special_tokens=skip_special_tokens)
    deltas = []
    for k, token_id in enumerate(ids):
        deltas.append(detok.add(token_id))
        assert detok.text == "".join(deltas)
        prefix_text = tok.decode(ids[:k + 1], skip_special_tokens=skip_special_tokens)
        # Emitted text is final (a prefix of every later decode) and complete once nothing is pending:
        # no unfinished character, and (ByteFallback) no open run of byte tokens.
        assert prefix_text.startswith(detok.text), (ids[:k + 1], detok.text, prefix_text)
        run_may_be_open = tok.byte_run_probe_id is not None and tok.convert_ids_to_tokens(ids[k:k + 1])[0][0] == "<"
        if not prefix_text.endswith("\ufffd") and not run_may_be_open:
            assert detok.text == prefix_text, (ids[:k + 1], detok.text, prefix_text)
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


def test_backends_and_vocab(bpe, sp, llama, bpe_dir, sp_dir):
    assert isinstance(bpe, HFTokenizer) and isinstance(llama, HFTokenizer) and isinstance(sp, SentencePieceTokenizer)
    raw_vocab = json.loads((bpe_dir / "tokenizer.json").read_text())["model"]["vocab"]
    assert bpe.vocab_size == len(raw_vocab) + 1
    assert bpe.encode("<|tool|>", add_special_tokens=False) == [bpe.vocab_size - 1]
    assert sp.vocab_size == spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model")).get_piece_size()
    assert bpe.bos_token_id is None and sp.bos_token_id == 1 and llama.bos_token_id == 1
    assert llama.eos_token_ids == [2] and llama.encode("Hello")[0] == 1
    # Only the ByteFallback decoder lets a later byte token rewrite earlier text.
    assert llama.byte_run_probe_id == llama.encode("<0x80>", add_special_tokens=False)[0] \
        or llama.byte_run_probe_id == llama.hf.convert_tokens_to_ids("<0x80>")
    assert bpe.byte_run_probe_id is None and sp.byte_run_probe_id is None


@pytest.mark.parametrize("name", ["bpe", "llama"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_fast_decode_is_transformers_decode(request, name, skip_special_tokens):
    """HFTokenizer.decode calls the Rust tokenizer directly (transformers' decode without clean-up
    is that call; its Python wrapper was most of a streamed token's cost): the same text for random
    ids, special tokens and byte runs included; a class overriding ``_decode`` keeps its own."""
    tok = request.getfixturevalue(name)
    assert tok._rust_decode is not None
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 12))]
        assert tok.decode(ids, skip_special_tokens=skip_special_tokens) == tok.hf.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False), ids

    class Overriding(type(tok.hf)):
        def _decode(self, token_ids, **kw):
            return "own"

    other = object.__new__(HFTokenizer)
    other.hf = object.__new__(Overriding)
    assert other._find_rust_decode() is None


@pytest.mark.parametrize("text", MIXED_TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text)) == text


def test_sentencepiece_special_tokens(sp):
    ids = sp.encode("Hello world")
    assert ids[0] == sp.bos_token_id and sp.convert_ids_to_tokens(ids[:1]) == ["<s>"]
    assert sp.decode(ids + [2]) == "Hello world"
    assert sp.decode(ids + [2], skip_special_tokens=False) == "<s>Hello world</s>"
    assert "<0xE4>" in sp.convert_ids_to_tokens(sp.encode("你"))


def test_eos_ids_include_generation_config(bpe, sp, sp_dir):
    assert bpe.eos_token_ids == [2, 0]  # tokenizer's <|im_end|> first, duplicate dropped
    assert sp.eos_token_ids == [2, 7]
    assert Tokenizer.from_pretrained(sp_dir / "tokenizer.model").eos_token_ids == [2, 7]


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_pretrained(tmp_path / "missing")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    shutil.copy(tmp_path / "generation_config.json", tmp_path / "tokenizer.txt")
    with pytest.raises(ValueError, match="tokenizer.txt"):
        Tokenizer.from_pretrained(tmp_path / "tokenizer.txt")


def test_config_without_tokenizer_json_falls_back_to_sentencepiece(sp_dir, tmp_path):
    shutil.copy(sp_dir / "tokenizer.model", tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    tok = Tokenizer.from_pretrained(tmp_path)  # AutoTokenizer if it can convert the model, else sentencepiece
    assert tok.decode(tok.encode("你好 Hello")) == "你好 Hello"


@pytest.mark.parametrize("text", MIXED_TEXTS)
def test_stream_text_equals_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    deltas, tail = stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids) == text
    assert tail == "" or tok.byte_run_probe_id is not None  # ByteFallback: text may end in an open run
    assert not any("\ufffd" in d for d in deltas + [tail])


def test_multi_token_characters_are_held_back(tok):
    ids = tok.encode("a🌍", add_special_tokens=False)
    assert len(tok.encode("🌍", add_special_tokens=False)) > 1
    deltas, tail = stream(tok, ids)
    assert "".join(deltas) + tail == "a🌍" and "🌍" in deltas + [tail]  # emitted whole, never split
    # Generation stopped mid-character: flush gives exactly what the full decode gives.
    deltas, tail = stream(tok, ids[:-1])
    assert "".join(deltas) == "a" and tail == tok.decode(ids[:-1])[1:] and tail.startswith("\ufffd")


def test_special_token_inside_a_character(bpe):
    ids = bpe.encode("你", add_special_tokens=False)
    assert len(ids) > 1
    ids = ids[:1] + [2] + ids[1:]  # <|im_end|> between the bytes of one character
    for skip in (True, False):
        deltas, tail = stream(bpe, ids, skip_special_tokens=skip)
        assert "".join(deltas) + tail == bpe.decode(ids, skip_special_tokens=skip)
    assert bpe.decode(ids) == "你"


def test_sentencepiece_leading_space(sp):
    ids = sp.encode(" Hello world", add_special_tokens=False)
    assert "".join(sp.convert_ids_to_tokens(ids)).startswith("▁▁")  # dummy prefix plus the real space
    deltas, _ = stream(sp, ids)
    assert "".join(deltas) == sp.decode(ids) == " Hello world"
    ids = sp.encode("Hello world", add_special_tokens=False)
    deltas, _ = stream(sp, ids)  # the first output token's "▁" is dropped, as in the full decode
    assert deltas[0] == sp.decode(ids[:1]) and not deltas[0].startswith(" ")
    assert "".join(deltas) == "Hello world"


def test_byte_fallback_run_is_held_until_closed(llama):
    ids = llama.encode("a你好", add_special_tokens=False)
    assert llama.convert_ids_to_tokens(ids[-6:]) == ["<0xE4>", "<0xBD>", "<0xA0>", "<0xE5>", "<0xA5>", "<0xBD>"]
    # Cut mid-character: ByteFallback turns the whole run, "你" included, into U+FFFD.
    assert llama.decode(ids[:-1]) == "a" + "\ufffd" * 5
    deltas, tail = stream(llama, ids[:-1])
    assert "".join(deltas) == "a" and tail == "\ufffd" * 5
    ids = llama.encode("a你好 world", add_special_tokens=False)
    deltas, tail = stream(llama, ids)
    assert llama.convert_ids_to_tokens(ids[8:9]) == ["▁"] and deltas[2:9] == [""] * 6 + ["你好 "]
    assert "".join(deltas) + tail == "a你好 world" and not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_random_ids(tok, skip_special_tokens):
    rng = random.Random(0)
    for _ in range(150):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        deltas, tail = stream(tok, ids, skip_special_tokens)
        assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip_special_tokens), ids


def test_stream_random_byte_runs(tok):
    """Random valid and invalid UTF-8, one byte per token where the vocabulary allows."""
    rng = random.Random(1)
    alphabet = "aé你🌍🚀 \n"
    for _ in range(100):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        ids = tok.encode(text, add_special_tokens=False)
        cut = ids[rng.randrange(len(ids)):] + ids[:rng.randrange(len(ids) + 1)]  # may start or end mid-char
        deltas, tail = stream(tok, cut)
        full = tok.decode(cut)
        assert "".join(deltas) + tail == full, cut
        if "\ufffd" not in full:
            assert tail == "" or tok.byte_run_probe_id is not None
            assert not any("\ufffd" in d for d in deltas + [tail])


def test_decode_window_is_bounded(tok, monkeypatch):
    """Each step decodes a window of a few tokens, never the whole output.

    With ByteFallback the window also spans an open run of byte tokens (here up to 15: "你好，世界").
    """
    ids = tok.encode(" ".join(CORPUS[:4] + MIXED_TEXTS[:3]) * 4, add_special_tokens=False)
    assert len(ids) > 300
    lengths = []
    decode = tok.decode

    def recording_decode(token_ids, skip_special_tokens=True):
        lengths.append(len(token_ids))
        return decode(token_ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(tok, "decode", recording_decode)
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    monkeypatch.undo()
    assert text == tok.decode(ids)
    assert max(lengths) <= (12 if tok.byte_run_probe_id is None else 40), max(lengths)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_token_text_is_the_decode_of_the_token_alone(tok, skip_special_tokens, monkeypatch):
    """Tokenizer.token_text: decode([id]) for every id, special ones included; asked again, it
    decodes nothing."""
    ids = range(min(tok.vocab_size, 3000))
    assert [tok.token_text(i, skip_special_tokens) for i in ids] == [
        tok.decode([i], skip_special_tokens=skip_special_tokens) for i in ids]
    monkeypatch.setattr(tok, "decode", lambda *a, **k: pytest.fail("decoded again"))
    assert tok.token_text(5, skip_special_tokens) == tok.token_text(5, skip_special_tokens)


def test_a_streamed_token_whose_text_is_final_costs_one_decode(bpe, monkeypatch):
    """The prefix window after a delta is most often one token: its text comes from token_text, so
    a step decodes the window once."""
    ids = bpe.encode("the quick brown fox jumps over the lazy dog " * 3, add_special_tokens=False)
    for i in ids:
        bpe.token_text(i)
    calls = []
    decode = bpe.decode
    monkeypatch.setattr(bpe, "decode", lambda token_ids, **k: calls.append(list(token_ids)) or decode(token_ids, **k))
    detok = IncrementalDetokenizer(bpe)
    deltas = [detok.add(i) for i in ids]
    assert all(deltas) and "".join(deltas) == decode(ids)
    assert len(calls) == len(ids)


def test_add_after_flush_raises(bpe):
    detok = IncrementalDetokenizer(bpe)
    detok.add(bpe.encode("hi", add_special_tokens=False)[0])
    detok.flush()
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.add(5)


def test_chat_template_chatml(bpe):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "你好 "}, {"type": "text", "text": "there"}]},
    ]
    ids = bpe.apply_chat_template(messages)
    assert all(isinstance(i, int) for i in ids)
    assert ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|>, <|im_end|> are single tokens
    assert bpe.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n你好 there<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = bpe.apply_chat_template(messages, add_generation_prompt=False)
    assert ids[:len(no_prompt)] == no_prompt and len(ids) > len(no_prompt)


@pytest.mark.parametrize("name", ["sp", "llama"])
def test_chat_template_fallback(request, name):
    tok = request.getfixturevalue(name)  # raw sentencepiece, and an HF tokenizer without a template
    assert tok.chat_template == FALLBACK_CHAT_TEMPLATE
    ids = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == "System: Be brief.\n\nUser: hi\n\nAssistant:"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert tok.decode(ids) == "User: hi\n\n"


@pytest.mark.parametrize("messages, field", [
    ([], "messages"),
    ("hi", "messages"),
    (None, "messages"),
    (["hi"], "messages[0]"),
    ([{"content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}], "messages[1].role"),
    ([{"role": ["user"], "content": "hi"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": ["hi"]}], "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content[0].text"),
])
def test_bad_messages_name_the_field(tok, messages, field):
    with pytest.raises(ValueError, match="^" + re.escape(field) + ":"):
        tok.apply_chat_template(messages)
