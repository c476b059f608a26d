"""GGUF files with a SentencePiece tokenizer (`tokenizer.ggml.model == "llama"`: Llama 2, Mistral):
pdkv's tokenizer equals SentencePiece itself on plain text (spaces, byte fallback), puts the leading
space after special tokens as llama.cpp does, adds BOS as the file says, round-trips through decode,
streams the same text, and agrees with transformers' GGUF tokenizer where that one follows SentencePiece."""
import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is the reference GGUF loader")
pytest.importorskip("gguf", reason="the gguf package writes and reads GGUF files")
pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate")
pytest.importorskip("sentencepiece", reason="SentencePiece is the reference encoder")

from gguf_cases import CORPUS, SPM_CONTROL, hf_model, train_sentencepiece, write_gguf

from pd.engine.model.gguf import resolve_checkpoint
from pd.engine.text.gguf_tokenizer import GGUFTokenizerError, write_tokenizer_files
from pd.engine.text.tokenizer import HFTokenizer, load_tokenizer
from pd.router.text_stream import TextStream

UNK, BOS, EOS = 0, 1, 2
PLAIN = CORPUS + [
    "  two  spaces\n\tand a tab", " leading space", "trailing space ", "a\n\nb", "", " ", "\n", "123456",
    "unseen: Q\u20ac\U0001f980 xyzQ", "\u2581literal meta-space", "Mixed CASE and punctuation!?;:",
]
UNSEEN = "Q\u20ac\U0001f980"  # not in the trained vocabulary: byte fallback


@pytest.fixture(scope="module")
def spm():
    return train_sentencepiece()


@pytest.fixture(scope="module")
def spm_gguf(spm, tmp_path_factory):
    """(GGUF path, pdkv's tokenizer of it); the conversion cache is private to this module."""
    _, tokens, scores, types = spm
    root = tmp_path_factory.mktemp("spm")
    path = write_gguf(root / "tiny-spm.gguf", hf_model("llama", len(tokens)), tokens, [], tokenizer_model="llama",
                      pre=None, scores=scores, token_types=types, add_bos=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDKV_CACHE_DIR", str(root / "cache"))
        tokenizer = load_tokenizer(path)
        directory = resolve_checkpoint(path)
    return path, tokenizer, directory


def _metadata(spm, **overrides):
    _, tokens, scores, types = spm
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": BOS,
            "tokenizer.ggml.eos_token_id": EOS, "tokenizer.ggml.unknown_token_id": UNK}
    meta.update(overrides)
    return {k: v for k, v in meta.items() if v is not None}


def _built(spm, tmp_path: Path, **overrides) -> HFTokenizer:
    meta = _metadata(spm, **overrides)
    write_tokenizer_files(lambda key, default=None: meta.get(key, default), tmp_path, 512)
    return HFTokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("text", PLAIN)
def test_ids_equal_sentencepiece_and_decode_round_trips(spm, spm_gguf, text):
    sp, tokens, _, _ = spm
    _, tokenizer, _ = spm_gguf
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == sp.encode(text), [tokens[i] for i in ids]
    assert tokenizer.decode(ids) == sp.decode(ids) == text.replace("\u2581", " ")  # "▁" is a space's spelling
    assert tokenizer.encode(text) == [BOS] + ids  # tokenizer.ggml.add_bos_token is true


def test_spaces_are_meta_spaces_with_one_leading(spm, spm_gguf):
    _, tokens, _, _ = spm
    _, tokenizer, _ = spm_gguf
    pieces = [tokens[i] for i in tokenizer.encode("the capital", add_special_tokens=False)]
    assert pieces == ["\u2581the", "\u2581capital"]
    pieces = [tokens[i] for i in tokenizer.encode("  the", add_special_tokens=False)]
    assert "".join(pieces) == "\u2581\u2581\u2581the"  # the added prefix plus the text's own two spaces


def test_characters_outside_the_vocabulary_fall_back_to_bytes(spm, spm_gguf):
    _, tokens, _, types = spm
    _, tokenizer, _ = spm_gguf
    assert not any(ch in tokens for ch in UNSEEN)
    ids = tokenizer.encode(UNSEEN, add_special_tokens=False)
    pieces = [tokens[i] for i in ids]
    assert pieces == ["\u2581"] + [f"<0x{b:02X}>" for b in UNSEEN.encode("utf-8")]
    assert all(types[i] == 6 for i in ids[1:])  # gguf.TokenType.BYTE
    assert UNK not in ids and tokenizer.decode(ids) == UNSEEN


def test_special_tokens_stay_whole_and_the_text_after_them_gets_its_leading_space(spm, spm_gguf):
    """As llama.cpp (and a SentencePiece pipeline encoding piece by piece): each text piece is encoded
    on its own, with its own leading space."""
    sp, tokens, _, _ = spm
    _, tokenizer, _ = spm_gguf
    user, assistant = (tokens.index(t) for t in SPM_CONTROL)
    text = f"{SPM_CONTROL[0]}\nHello there</s>{SPM_CONTROL[1]}\n"
    want = [user] + sp.encode("\nHello there") + [EOS, assistant] + sp.encode("\n")
    assert tokenizer.encode(text, add_special_tokens=False) == want
    assert tokenizer.special_token_ids >= {UNK, BOS, EOS, user, assistant}
    assert tokenizer.decode(want, skip_special_tokens=False) == (
        f"{SPM_CONTROL[0]} \nHello there</s>{SPM_CONTROL[1]} \n")
    assert tokenizer.encode("<unk>", add_special_tokens=False) == [UNK]


def test_streamed_text_equals_the_full_decode(spm, spm_gguf):
    sp, _, _, _ = spm
    _, tokenizer, _ = spm_gguf
    text = "Caf\u00e9 " + UNSEEN + " over the lazy dog, 3.14159 \U0001f916!"
    ids = sp.encode(text)
    stream = TextStream(tokenizer, stop=("lazy d",))
    shown = "".join(stream.push([i]) for i in ids) + stream.flush()
    assert stream.stopped and shown == text[:text.index("lazy d")]
    stream = TextStream(tokenizer)
    pieces = [stream.push([i]) for i in ids]
    assert "".join(pieces) + stream.flush() == text
    assert not any("\ufffd" in p for p in pieces)  # a character cut into byte tokens waits for its last byte


def test_ids_equal_transformers_gguf_tokenizer(spm, spm_gguf):
    """Where transformers follows SentencePiece (text not starting with a space, no special token
    inside), its GGUF tokenizer and pdkv's give the same ids."""
    sp, _, _, _ = spm
    path, tokenizer, _ = spm_gguf
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = [t for t in PLAIN if t and not t.startswith((" ", "\u2581"))]
    assert len(texts) >= 10
    for text in texts:
        assert tokenizer.encode(text) == reference(text)["input_ids"] == [BOS] + sp.encode(text), text
        assert tokenizer.decode(tokenizer.encode(text)) == reference.decode(reference(text)["input_ids"],
                                                                              skip_special_tokens=True)


def test_tokenizer_files_carry_the_special_tokens(spm, spm_gguf):
    _, tokenizer, directory = spm_gguf
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["unk_token"]) == ("<s>", "</s>", "<unk>")
    assert config["add_bos_token"] is True
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.eos_token_ids) == (BOS, EOS, (EOS,))
    assert tokenizer.vocab_size == len(spm[1])


def test_add_bos_and_space_prefix_follow_the_metadata(spm, tmp_path):
    sp, _, _, _ = spm
    default = _built(spm, tmp_path / "default")  # no add_bos_token key: llama.cpp's default for SentencePiece
    assert default.encode("Hello") == [BOS] + sp.encode("Hello")
    no_bos = _built(spm, tmp_path / "no-bos", **{"tokenizer.ggml.add_bos_token": False})
    assert no_bos.encode("Hello") == sp.encode("Hello")
    bare = _built(spm, tmp_path / "bare", **{"tokenizer.ggml.add_space_prefix": False})
    ids = bare.encode("Hello world", add_special_tokens=False)
    pieces = [sp.id_to_piece(i) for i in ids]
    assert "".join(pieces) == "Hello\u2581world" and pieces[-1] == "\u2581world"  # no space put in front
    assert bare.decode(ids) == "Hello world"
    assert bare.decode(bare.encode(" x", add_special_tokens=False)) == " x"  # nor one taken off


def test_merges_in_the_file_are_used_as_given(spm, tmp_path):
    sp, tokens, _, _ = spm
    # only the merges that build "▁the": every other word stays in single characters
    assert {"\u2581t", "he", "\u2581the"} <= set(tokens)
    merges = ["\u2581 t", "h e", "\u2581t he"]
    tokenizer = _built(spm, tmp_path, **{"tokenizer.ggml.merges": merges, "tokenizer.ggml.scores": None})
    pieces = [tokens[i] for i in tokenizer.encode("the cat", add_special_tokens=False)]
    assert pieces == ["\u2581the", "\u2581", "c", "a", "t"]


@pytest.mark.parametrize("overrides, message", [
    ({"tokenizer.ggml.scores": None}, r"tokenizer\.ggml\.scores: missing"),
    ({"tokenizer.ggml.scores": [0.0, 1.0]}, r"tokenizer\.ggml\.scores: 2 entries"),
    ({"tokenizer.ggml.model": "t5"}, r"tokenizer\.ggml\.model: 't5' is not supported"),
    ({"tokenizer.ggml.model": None}, r"tokenizer\.ggml\.model: None is not supported"),
    ({"tokenizer.ggml.bos_token_id": 10**6}, r"tokenizer\.ggml\.bos_token_id: 1000000 outside"),
])
def test_bad_metadata_is_refused_naming_the_key(spm, tmp_path, overrides, message):
    with pytest.raises(GGUFTokenizerError, match=message):
        _built(spm, tmp_path, **overrides)


def test_a_vocabulary_without_byte_tokens_needs_an_unknown_token(spm, tmp_path):
    _, tokens, scores, types = spm
    keep = [i for i, k in enumerate(types) if k != 6]  # drop the <0xXX> tokens
    renumbered = {"tokenizer.ggml.tokens": [tokens[i] for i in keep],
                  "tokenizer.ggml.scores": [scores[i] for i in keep],
                  "tokenizer.ggml.token_type": [types[i] for i in keep]}
    with pytest.raises(GGUFTokenizerError, match=r"tokenizer\.ggml\.unknown_token_id: missing"):
        _built(spm, tmp_path / "no-unk", **renumbered, **{"tokenizer.ggml.unknown_token_id": None})
    tokenizer = _built(spm, tmp_path / "unk", **renumbered)
    assert tokenizer.encode("Q", add_special_tokens=False)[-1] == UNK  # nothing silently dropped
