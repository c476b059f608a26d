"""`pd.loadgen`'s command line is `vllm bench serve`'s on the documented subset,
and its datasets measure prompts with a real Hugging Face tokenizer."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from pd.tools.loadgen.cli import parse_args
from pd.tools.loadgen.data import ByteLengths, HFLengths, load_tokenizer, make_dataset

REPO = Path(__file__).resolve().parents[2]

# The documented command (docs/serving.md, "Load generator"): only the program name differs from vLLM's.
DOCUMENTED = """--backend openai --base-url http://127.0.0.1:8000 --endpoint /v1/completions --model pdkv-tiny
  --dataset-name random --random-input-len 512 --random-output-len 64 --random-range-ratio 0.25
  --num-prompts 200 --request-rate 8 --burstiness 1 --max-concurrency 32 --goodput ttft:500 tpot:50
  --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --num-warmups 2 --seed 0
  --ignore-eos --temperature 0 --save-result --result-dir results --result-filename run.json"""


def test_documented_vllm_command_line_parses():
    args = parse_args(shlex.split(DOCUMENTED))
    assert (args.backend, args.base_url, args.endpoint, args.model) == (
        "openai", "http://127.0.0.1:8000", "/v1/completions", "pdkv-tiny")
    assert (args.dataset_name, args.random_input_len, args.random_output_len, args.random_range_ratio) == (
        "random", 512, 64, 0.25)
    assert (args.num_prompts, args.request_rate, args.burstiness, args.max_concurrency) == (200, 8.0, 1.0, 32)
    assert args.goodput == {"ttft": 500.0, "tpot": 50.0}  # vLLM's form: separate KEY:MS words
    assert args.percentile_metrics == ("ttft", "tpot", "itl", "e2el") and args.metric_percentiles == (50.0, 90.0, 99.0)
    assert args.num_warmups == 2 and args.save_result and args.result_filename == "run.json"
    page = (REPO / "docs" / "serving.md").read_text().replace("\\\n", " ")  # shell line continuations
    assert "python -m pd.loadgen " + " ".join(DOCUMENTED.split()) in " ".join(page.split()), \
        "the load generator command in docs/serving.md differs from the one tested here"


def test_prefix_repetition_and_sharegpt_flags(tmp_path):
    args = parse_args(["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "64",
                       "--prefix-repetition-suffix-len", "32", "--prefix-repetition-num-prefixes", "3",
                       "--prefix-repetition-output-len", "16", "--num-prompts", "9", "--backend", "openai-chat"])
    assert args.endpoint == "/v1/chat/completions" and not args.ignore_eos
    rows = make_dataset(args, ByteLengths())
    assert len({r.prompt[:60] for r in rows}) == 3 and {r.expected_output_len for r in rows} == {16}

    share = tmp_path / "sharegpt.json"
    share.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "What is KV cache?"}, {"from": "gpt", "value": "Keys."}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {"id": "no conversations"},
        {"conversations": [{"from": "human", "value": "Why P/D?"}, {"from": "gpt", "value": "Prefill is heavy."}]},
    ]))
    rows = make_dataset(parse_args(["--dataset-name", "sharegpt", "--dataset-path", str(share), "--num-prompts", "4",
                                    "--disable-shuffle"]), ByteLengths())
    assert [r.prompt for r in rows] == ["What is KV cache?", "Why P/D?"] * 2
    assert [r.expected_output_len for r in rows[:2]] == [len("Keys."), len("Prefill is heavy.")]
    rows = make_dataset(parse_args(["--dataset-name", "sharegpt", "--dataset-path", str(share), "--num-prompts", "2",
                                    "--sharegpt-output-len", "7"]), ByteLengths())
    assert {r.expected_output_len for r in rows} == {7}


@pytest.mark.parametrize("argv, message", [
    (["--goodput", "ttft=500"], "--goodput"),
    (["--goodput", "latency:5"], "--goodput"),
    (["--percentile-metrics", "ttft,foo"], "--percentile-metrics"),
    (["--metric-percentiles", "99,abc"], "--metric-percentiles"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio"),
    (["--dataset-name", "sonnet"], "--dataset-name"),
])
def test_bad_flags_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_dataset_path_errors_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--dataset-path"):
        make_dataset(parse_args(["--dataset-name", "sharegpt"]), ByteLengths())
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="--dataset-path .*not JSON"):
        make_dataset(parse_args(["--dataset-name", "sharegpt", "--dataset-path", str(bad)]), ByteLengths())
    with pytest.raises(ValueError, match="takes no --dataset-path"):
        make_dataset(parse_args(["--dataset-path", str(bad)]), ByteLengths())
    with pytest.raises(ValueError, match="--tokenizer"):
        load_tokenizer(str(tmp_path))


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory) -> Path:
    """A real BPE tokenizer (trained here with the `tokenizers` library), saved as tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    from pd.tools.loadgen.data import _WORDS

    corpus = [" ".join(_WORDS)] * 4 + ["the quick brown fox jumps over the lazy dog " * 4]
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    directory = tmp_path_factory.mktemp("tok")
    tok.save(str(directory / "tokenizer.json"))
    return directory


def test_hf_tokenizer_measures_prompt_lengths(hf_tokenizer_dir):
    tok = load_tokenizer(str(hf_tokenizer_dir))
    assert isinstance(tok, HFLengths) and tok.count("the quick") >= 2
    args = parse_args(["--tokenizer", str(hf_tokenizer_dir), "--num-prompts", "20", "--random-input-len", "50",
                       "--random-output-len", "4", "--random-range-ratio", "0.2"])
    rows = make_dataset(args, tok)
    for r in rows:
        assert r.prompt_len == tok.count(r.prompt)
        assert 40 - 2 <= r.prompt_len - 1 <= 60, r.prompt_len  # the sampled length, to a token or two
    byte_lens = [ByteLengths().count(r.prompt) for r in rows]
    assert sum(byte_lens) > 1.5 * sum(r.prompt_len for r in rows)  # BPE merges: fewer tokens than bytes
    prefix_rows = make_dataset(parse_args(["--tokenizer", str(hf_tokenizer_dir), "--dataset-name",
                                           "prefix_repetition", "--prefix-repetition-prefix-len", "30",
                                           "--prefix-repetition-suffix-len", "10", "--num-prompts", "4"]), tok)
    assert all(38 <= r.prompt_len <= 44 for r in prefix_rows), [r.prompt_len for r in prefix_rows]
