"""The checkpoint tokenizer with a real byte-level BPE trained here by `tokenizers`,
saved as a Hugging Face checkpoint directory: ids, special tokens, stop ids, chat
templates (against transformers when installed), and streaming detokenisation."""
from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pd.engine.text.chat_template import ChatTemplateError
from pd.engine.text.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from pd.router.text_stream import TextStream

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The café serves crème brûlée and a naïve résumé. ",
    "日本語のテキストです。日本語は美しい。東京と大阪。",
    "Emoji: 🙂 🚀 🎉 and flags 🇫🇷 mixed with text 🙂🙂. ",
    "Grüße aus München! Ça va? Здравствуй, мир. Γειά σου κόσμε.",
    "hello world, hello there, the quick brown fox jumps over the lazy dog.",
]
SAMPLE = "Hello café 日本語 🙂🚀 naïve — Grüße, мир! the end."

# SmolLM2-style: ChatML turns, a default system prompt, indented blocks (trim_blocks/lstrip_blocks matter)
CHATML_TEMPLATE = """{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}
    {% endif %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) -}}
    {% endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' -}}
{% endif %}"""

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Réponds en français."}, {"role": "user", "content": "日本語で？ 🙂"},
     {"role": "assistant", "content": "はい。"}, {"role": "user", "content": "  spaces  kept  "}],
]


def _write(path, name, data):
    (path / name).write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A ChatML checkpoint directory (SmolLM2-like: BOS/EOS are <|im_start|>/<|im_end|>)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS * 20, trainer)
    path = tmp_path_factory.mktemp("chatml")
    backend.save(str(path / "tokenizer.json"))
    _write(path, "tokenizer_config.json", {
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "unk_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": CHATML_TEMPLATE, "tokenizer_class": "GPT2Tokenizer", "clean_up_tokenization_spaces": False,
    })
    _write(path, "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2})
    return path


@pytest.fixture(scope="module")
def llama_style(checkpoint, tmp_path_factory):
    """Same vocabulary, no post-processor, Llama-style config: add_bos_token, a list of stop ids, no chat template."""
    path = tmp_path_factory.mktemp("llama")
    data = json.loads((checkpoint / "tokenizer.json").read_text(encoding="utf-8"))
    data["post_processor"] = None
    _write(path, "tokenizer.json", data)
    _write(path, "tokenizer_config.json", {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
                                           "add_bos_token": True, "add_eos_token": False})
    _write(path, "generation_config.json", {"eos_token_id": [0, 2]})
    return path


@pytest.fixture(scope="module")
def tok(checkpoint):
    return load_tokenizer(str(checkpoint))


def test_round_trip_and_vocabulary(tok, checkpoint):
    vocab = json.loads((checkpoint / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == len(vocab) > 256 + len(SPECIALS)
    for text in CORPUS + [SAMPLE, "", " leading and trailing  ", "unseen: ŝ ǅ 𝔘 🦀"]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    ids = tok.encode(SAMPLE)
    # the vocabulary really cuts characters: some single tokens are partial UTF-8
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    with pytest.raises(ValueError, match="outside vocabulary"):
        tok.decode([tok.vocab_size])


def test_special_tokens_bos_eos_and_stop_ids(tok, llama_style):
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (1, 2, (2,))
    assert tok.special_token_ids == {0, 1, 2}
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # special-token text becomes the special ids
    assert tok.encode("hi")[0] != 1  # this checkpoint's post-processor adds no BOS
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"

    llama = load_tokenizer(llama_style)
    assert (llama.bos_token_id, llama.eos_token_id, llama.eos_token_ids) == (0, 2, (0, 2))
    assert llama.encode("hi")[0] == 0 and llama.encode("hi", add_special_tokens=False)[0] != 0
    assert llama.encode("hi")[1:] == llama.encode("hi", add_special_tokens=False)


def test_chat_rendering(tok, llama_style):
    text = tok.render_chat(CHATS[0])
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.render_chat(CHATS[0], add_generation_prompt=False) == text.removesuffix("<|im_start|>assistant\n")
    ids = tok.encode_chat(CHATS[1])
    assert ids.count(1) == 5 and ids.count(2) == 4 and tok.decode(ids, skip_special_tokens=False) == \
        tok.render_chat(CHATS[1])
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        tok.render_chat([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\].role"):
        tok.render_chat([{"content": "x"}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        load_tokenizer(llama_style).render_chat(CHATS[0])
    byte = ByteTokenizer()
    assert byte.render_chat(CHATS[0]) == "<|user|>\nWhat is the capital of France?\n<|assistant|>\n"
    assert byte.encode_chat(CHATS[0])[0] == byte.bos_token_id


def test_matches_transformers(tok, checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(checkpoint))
    for chat in CHATS:
        for gen in (True, False):
            expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert tok.render_chat(chat, add_generation_prompt=gen) == expected
            assert tok.encode_chat(chat, add_generation_prompt=gen) == hf.encode(expected, add_special_tokens=False)
    ids = hf.encode(SAMPLE)
    assert tok.encode(SAMPLE) == ids and tok.decode(ids + [2]) == hf.decode(ids + [2], skip_special_tokens=True)
    # with a post-processor in tokenizer.json, transformers 5 ignores add_bos_token: so do we
    flagged = tmp_path / "flagged"
    flagged.mkdir()
    for name in ("tokenizer.json", "generation_config.json"):
        (flagged / name).write_bytes((checkpoint / name).read_bytes())
    config = json.loads((checkpoint / "tokenizer_config.json").read_text(encoding="utf-8"))
    _write(flagged, "tokenizer_config.json", {**config, "add_bos_token": True, "add_eos_token": True})
    hf_flagged = transformers.PreTrainedTokenizerFast.from_pretrained(str(flagged))
    assert load_tokenizer(flagged).encode(SAMPLE) == hf_flagged.encode(SAMPLE) == ids
    raw = transformers.PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"))
    assert tok.encode(SAMPLE, add_special_tokens=False) == raw.encode(SAMPLE, add_special_tokens=False)


def test_load_tokenizer_errors(tmp_path, checkpoint):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="got another file"):
        load_tokenizer(tmp_path / "model.bin")
    (tmp_path / "tokenizer.json").write_bytes((checkpoint / "tokenizer.json").read_bytes())
    _write(tmp_path, "generation_config.json", {"eos_token_id": "two"})
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id"):
        load_tokenizer(tmp_path)
    _write(tmp_path, "generation_config.json", {})
    _write(tmp_path, "tokenizer_config.json", {"eos_token": "</s>"})
    with pytest.raises(ValueError, match="eos_token '</s>' is not in tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{", encoding="utf-8")
    with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
        load_tokenizer(tmp_path)


def _stream(tokenizer, ids, cuts, stop=()):
    """The pieces a TextStream hands out when `ids` arrive split at `cuts`."""
    stream = TextStream(tokenizer, stop=stop)
    bounds = [0, *cuts, len(ids)]
    pieces = [stream.push(ids[a:b]) for a, b in zip(bounds, bounds[1:])]
    return pieces + [stream.flush()], stream


def _reference(text, stop):
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[:min(hits)] if hits else text


def test_stream_equals_decode_for_every_split(tok):
    ids = tok.encode(SAMPLE + "<|im_end|>")
    expected = tok.decode(ids)
    assert expected == SAMPLE
    one_by_one, _ = _stream(tok, ids, range(1, len(ids)))
    assert "".join(one_by_one) == expected and not any("\ufffd" in p for p in one_by_one)
    assert len([p for p in one_by_one if p]) > len(ids) // 2  # really incremental, not all held to the end
    for k in range(len(ids) + 1):
        pieces, _ = _stream(tok, ids, [k])
        assert "".join(pieces) == expected and not any("\ufffd" in p for p in pieces), k
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(ids)), rng.randint(1, 6)))
        assert "".join(_stream(tok, ids, cuts)[0]) == expected


def test_stop_string_spanning_tokens(tok):
    ids = tok.encode(SAMPLE)
    texts = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    # a boundary inside "日本語" where a token ends mid-character, and one between clean ASCII tokens
    spans = []
    for i in range(1, len(ids)):
        if "\ufffd" not in texts[i] and "\ufffd" not in texts[i + 1] and len(texts[i + 1]) > len(texts[i]):
            spans.append(SAMPLE[max(0, len(texts[i]) - 2):len(texts[i]) + 1])  # two chars before, one after
    cut_char = [i for i in range(1, len(ids)) if texts[i].endswith("\ufffd")]
    assert spans and cut_char
    stops = [spans[len(spans) // 2], SAMPLE[SAMPLE.index("本"):SAMPLE.index("本") + 2]]
    for stop in stops:
        expected = _reference(SAMPLE, [stop])
        assert expected != SAMPLE
        for cuts in (range(1, len(ids)), [len(ids) // 2], []):
            pieces, stream = _stream(tok, ids + [2], cuts, stop=[stop])
            assert "".join(pieces) == expected and stream.stopped and stream.text == expected, (stop, cuts)
            assert not any("\ufffd" in p for p in pieces)


def test_stop_strings_match_non_streamed_text_randomised(tok):
    """Overlapping and nested stop strings: the earliest occurrence wins, in any split."""
    byte = ByteTokenizer()
    # "c" completes first, but "abcd" starts earlier: the non-streamed cut is before "abcd"
    pieces, stream = _stream(byte, list(b"xabcdy"), range(1, 6), stop=["abcd", "c"])
    assert "".join(pieces) == "x" and stream.stopped
    pieces, stream = _stream(byte, list(b"xabcy"), range(1, 5), stop=["abcd", "c"])
    assert "".join(pieces) == "xab" and stream.stopped
    rng = random.Random(1)
    for trial in range(300):
        alphabet = "ab日 " if trial % 2 else "abc日 "  # a small alphabet makes overlapping stop strings common
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        stop = ["".join(rng.choice(alphabet[:-1]) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        expected = _reference(text, stop)
        for tokenizer in (byte, tok):
            ids = tokenizer.encode(text, add_special_tokens=False)
            cuts = sorted(rng.sample(range(1, len(ids)), rng.randint(0, len(ids) - 1))) if len(ids) > 1 else []
            pieces, stream = _stream(tokenizer, ids, cuts, stop=stop)
            assert "".join(pieces) == expected, (trial, text, stop, cuts)
            assert stream.stopped == any(s in text for s in stop)


def test_stream_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nbonjour<|im_end|>")
    assert "".join(_stream(tok, ids, range(1, len(ids)))[0]) == "assistant\nbonjour"
    stream = TextStream(tok, skip_special_tokens=False)
    assert "".join([stream.push([i]) for i in ids] + [stream.flush()]) == "<|im_start|>assistant\nbonjour<|im_end|>"
    with pytest.raises(ValueError, match="stop"):
        TextStream(tok, stop=[""])


FEATURE_TEMPLATE = """{{ bos_token }}{% for message in messages %}
  {% if message['role'] == 'system' %}{% continue %}{% endif %}
  {% if message['role'] == 'assistant' %}
    {% generation %}{{ message['content'] | tojson }}{% endgeneration %}
  {% else %}
    {{ message | tojson(indent=1, sort_keys=True) }}
  {% endif %}
{% endfor %}{{ eos_token if add_generation_prompt else '' }}"""


def test_template_features_match_transformers(checkpoint, tmp_path):
    """loopcontrols, the generation tag, tojson without HTML escaping and with arguments, special-token variables."""
    config = json.loads((checkpoint / "tokenizer_config.json").read_text(encoding="utf-8"))
    (tmp_path / "tokenizer.json").write_bytes((checkpoint / "tokenizer.json").read_bytes())
    _write(tmp_path, "tokenizer_config.json", config)
    (tmp_path / "chat_template.jinja").write_text(FEATURE_TEMPLATE, encoding="utf-8")  # wins over the config's
    tok = load_tokenizer(tmp_path)
    chat = [{"role": "system", "content": "hidden"}, {"role": "user", "content": "<b>café</b> & 日本"},
            {"role": "assistant", "content": "x < y 🙂"}]
    text = tok.render_chat(chat)
    assert "hidden" not in text and '"<b>café</b> & 日本"' in text and '"x < y 🙂"' in text
    assert text.startswith("<|im_start|>") and text.endswith("<|im_end|>")
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    for gen in (True, False):
        assert tok.render_chat(chat, add_generation_prompt=gen) == \
            hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        (tmp_path / "chat_template.jinja").write_text("{% for %}", encoding="utf-8")
        load_tokenizer(tmp_path)
