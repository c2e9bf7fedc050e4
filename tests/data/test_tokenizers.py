"""Tokenizers: round trips, BOS/EOS, vocabulary sizes, Llama 3 id layout, format detection and user errors."""

from __future__ import annotations

import base64
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import hf_tokenizer_folder
from torchtitan.datasets import Tokenizer, build_tokenizer
from torchtitan.datasets.tokenizer import HFTokenizer, SentencePieceTokenizer, TikTokenizer, _pieces_for_regex
from torchtitan.errors import UserError

REPO = Path(__file__).resolve().parents[2]
TIKTOKEN_MODEL = REPO / "assets" / "tokenizer" / "tiktoken_test.model"
SENTENCEPIECE_MODEL = REPO / "assets" / "tokenizer" / "sentencepiece_test.model"

TEXTS = [
    "The otter is a mammal that lives in the wetlands.",
    "Zoë and Łukasz met in Köln — 21 °C, 3 € each… «quoted»",
    "日本語のテキスト and emoji 🙂🚀 mixed with ASCII",
    "  leading spaces, double  spaces, tabs\tand\nnew\n\nlines\r\n  ",
    "text spelling specials: <|begin_of_text|> <|end_of_text|> <s> </s> <unk>",
    "1234567 + 89 = 1234656",
    "",
]


def _load_make_assets():
    spec = importlib.util.spec_from_file_location("make_assets", REPO / "scripts" / "make_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=["tiktoken", "sentencepiece"])
def tokenizer(request) -> Tokenizer:
    path = TIKTOKEN_MODEL if request.param == "tiktoken" else SENTENCEPIECE_MODEL
    return build_tokenizer(str(path))


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer: Tokenizer, text: str):
    ids = tokenizer.encode(text, bos=False, eos=False)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < tokenizer.n_words for i in ids)
    assert tokenizer.bos_id not in ids and tokenizer.eos_id not in ids  # text never yields special ids


def test_bos_eos_flags(tokenizer: Tokenizer):
    text = "A short sentence."
    plain = tokenizer.encode(text, bos=False, eos=False)
    assert tokenizer.encode(text, bos=True, eos=False) == [tokenizer.bos_id] + plain
    assert tokenizer.encode(text, bos=False, eos=True) == plain + [tokenizer.eos_id]
    assert tokenizer.encode(text, bos=True, eos=True) == [tokenizer.bos_id] + plain + [tokenizer.eos_id]
    assert tokenizer.encode("", bos=True, eos=True) == [tokenizer.bos_id, tokenizer.eos_id]
    assert tokenizer.bos_id != tokenizer.eos_id
    assert 0 <= tokenizer.bos_id < tokenizer.n_words and 0 <= tokenizer.eos_id < tokenizer.n_words


def test_special_ids_decode_like_llama3():
    tik = build_tokenizer(str(TIKTOKEN_MODEL))
    body = tik.encode("hello", bos=False, eos=False)
    assert tik.decode([tik.bos_id] + body + [tik.eos_id]) == "<|begin_of_text|>hello<|end_of_text|>"
    spm = build_tokenizer(str(SENTENCEPIECE_MODEL))
    body = spm.encode("hello", bos=False, eos=False)
    assert spm.decode([spm.bos_id] + body + [spm.eos_id]) == "hello"  # control pieces decode to nothing


def test_vocab_sizes_match_the_asset_script():
    make_assets = _load_make_assets()
    tik = build_tokenizer(str(TIKTOKEN_MODEL))
    ranks = len(TIKTOKEN_MODEL.read_bytes().splitlines())
    assert ranks == make_assets.TIKTOKEN_RANKS
    assert (tik.n_words, tik.bos_id, tik.eos_id) == (ranks + 256, ranks, ranks + 1)
    spm = build_tokenizer(str(SENTENCEPIECE_MODEL))
    assert spm.n_words == make_assets.SENTENCEPIECE_VOCAB
    assert (spm.bos_id, spm.eos_id) == (1, 2)


def test_llama3_pre_tokenization_splits_digits_in_threes():
    tik = build_tokenizer(str(TIKTOKEN_MODEL))
    pieces = [tik.decode([i]) for i in tik.encode("1234567", bos=False, eos=False)]
    assert "".join(pieces) == "1234567"
    # \p{N}{1,3}: no token crosses the 3-digit boundaries.
    boundaries, position = set(), 0
    for piece in pieces:
        position += len(piece)
        boundaries.add(position)
    assert {3, 6} <= boundaries


def _write_llama3_sized_table(path: Path) -> None:
    """128,000 ranks like Meta's tokenizer.model: the 256 bytes, then distinct multi-byte tokens."""
    tokens = [bytes([b]) for b in range(256)]
    for i in range(128_000 - 256):
        tokens.append(b"t" + i.to_bytes(3, "big"))
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % rank for rank, t in enumerate(tokens)))


def test_llama3_sized_table_places_specials_after_the_ranks(tmp_path: Path):
    path = tmp_path / "tokenizer.model"
    _write_llama3_sized_table(path)
    tok = build_tokenizer(str(path))
    assert isinstance(tok, TikTokenizer)
    assert (tok.n_words, tok.bos_id, tok.eos_id) == (128_256, 128_000, 128_001)
    assert tok.special_tokens["<|start_header_id|>"] == 128_006
    assert tok.special_tokens["<|end_header_id|>"] == 128_007
    assert tok.special_tokens["<|eot_id|>"] == 128_009
    assert tok.special_tokens["<|reserved_special_token_4|>"] == 128_008
    assert tok.special_tokens["<|reserved_special_token_250|>"] == 128_255
    text = "Llama 3 sized table, ünïcode 🙂"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == 128_000 and ids[-1] == 128_001 and tok.decode(ids[1:-1]) == text


def test_auto_detection_reads_content_not_file_names(tmp_path: Path):
    tik_named_model = tmp_path / "looks_like_spm.model"
    spm_named_bpe = tmp_path / "looks_like_tiktoken.tiktoken"
    shutil.copy(TIKTOKEN_MODEL, tik_named_model)
    shutil.copy(SENTENCEPIECE_MODEL, spm_named_bpe)
    assert isinstance(build_tokenizer(str(tik_named_model)), TikTokenizer)
    assert isinstance(build_tokenizer(str(spm_named_bpe)), SentencePieceTokenizer)
    assert isinstance(build_tokenizer(str(TIKTOKEN_MODEL), "tiktoken"), TikTokenizer)
    assert isinstance(build_tokenizer(str(SENTENCEPIECE_MODEL), "sentencepiece"), SentencePieceTokenizer)


def _assert_one_line_user_error(call) -> str:
    with pytest.raises(UserError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_user_errors_name_the_option(tmp_path: Path):
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(bytes(range(256)) * 4)
    bad_line = tmp_path / "bad.tiktoken"
    bad_line.write_bytes(b"IQ== 0\nnot-base64!! 1\n")
    gappy = tmp_path / "gappy.tiktoken"
    gappy.write_bytes(b"".join(base64.b64encode(bytes([b])) + b" %d\n" % (b * 2) for b in range(256)))
    cases = [
        lambda: build_tokenizer(str(tmp_path / "missing.model")),
        lambda: build_tokenizer(str(tmp_path)),
        lambda: build_tokenizer(str(garbage)),
        lambda: build_tokenizer(str(bad_line)),
        lambda: build_tokenizer(str(gappy)),
        lambda: build_tokenizer(str(SENTENCEPIECE_MODEL), "tiktoken"),
        lambda: build_tokenizer(str(TIKTOKEN_MODEL), "sentencepiece"),
    ]
    for case in cases:
        assert "model.tokenizer_path" in _assert_one_line_user_error(case)
    assert "model.tokenizer_type" in _assert_one_line_user_error(lambda: build_tokenizer(str(TIKTOKEN_MODEL), "bpe"))


def test_long_runs_are_cut_for_the_regex_and_still_round_trip():
    text = "word " * 30_000 + " " * 60_000 + "x" * 30_000 + "\n end"
    pieces = list(_pieces_for_regex(text))
    assert "".join(pieces) == text
    assert len(pieces) > 1 and all(len(p) <= 400_000 for p in pieces)
    assert all(" " * 25_001 not in p and "x" * 25_001 not in p for p in pieces)
    tik = build_tokenizer(str(TIKTOKEN_MODEL))
    assert tik.decode(tik.encode(text, bos=False, eos=False)) == text
    short = "short text is encoded in one piece"
    assert list(_pieces_for_regex(short)) == [short]


# ------------------------------------------------------------------------------------------------------------------
# Hugging Face tokenizer.json: the same ids as the tiktoken file of the same model


def _sample_documents(count: int) -> list[str]:
    with open(REPO / "assets" / "data" / "sample" / "sample.jsonl") as f:
        return [json.loads(line)["text"] for _, line in zip(range(count), f)]


def test_a_hugging_face_folder_and_its_tokenizer_json_give_the_tiktoken_ids(tmp_path: Path):
    folder = hf_tokenizer_folder(tmp_path / "Llama-like")
    tiktoken = build_tokenizer(str(TIKTOKEN_MODEL))
    texts = TEXTS + _sample_documents(100) + ["word " * 30_000 + " " * 60_000 + "x" * 30_000]
    for path in (folder, folder / "tokenizer.json"):
        hf = build_tokenizer(str(path))
        assert isinstance(hf, HFTokenizer)
        assert (
            (hf.n_words, hf.bos_id, hf.eos_id)
            == (tiktoken.n_words, tiktoken.bos_id, tiktoken.eos_id)
            == (
                2256,
                2000,
                2001,
            )
        )
        for text in texts:
            ids = hf.encode(text, bos=True, eos=True)
            # Text spelling a special token stays text, as with tiktoken; only the flags add BOS and EOS.
            assert ids == tiktoken.encode(text, bos=True, eos=True)
            assert hf.decode(ids) == tiktoken.decode(ids)
    assert isinstance(build_tokenizer(str(folder), "huggingface"), HFTokenizer)


def test_hugging_face_tokenizer_mistakes_are_one_line(tmp_path: Path):
    folder = hf_tokenizer_folder(tmp_path / "model")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    no_specials = tmp_path / "no_specials"
    no_specials.mkdir()
    with open(folder / "tokenizer.json") as f:
        data = json.load(f)
    data["added_tokens"] = []
    (no_specials / "tokenizer.json").write_text(json.dumps(data))
    cases = [
        lambda: build_tokenizer(str(tmp_path / "empty_folder_missing")),
        lambda: build_tokenizer(str(broken)),
        lambda: build_tokenizer(str(no_specials)),
        lambda: build_tokenizer(str(folder), "tiktoken"),
    ]
    (tmp_path / "empty").mkdir()
    cases.append(lambda: build_tokenizer(str(tmp_path / "empty")))
    messages = [_assert_one_line_user_error(case) for case in cases]
    assert all("model.tokenizer_path" in message for message in messages)
    assert "no <|begin_of_text|>" in messages[2] and "without tokenizer.json" in messages[4]


def test_a_hugging_face_tokenizer_has_a_fingerprint_of_its_files(tmp_path):
    """Runs record the fingerprint of the tokenizer they read with (dataset.json, the tokens manifest check)."""
    folder = hf_tokenizer_folder(tmp_path / "model")
    first = build_tokenizer(str(folder)).fingerprint
    assert first == build_tokenizer(str(folder / "tokenizer.json")).fingerprint and len(first) == 16
    other = json.loads((folder / "tokenizer.json").read_text())
    other["added_tokens"][-1]["content"] += "x"  # another special token
    (folder / "tokenizer.json").write_text(json.dumps(other))
    assert build_tokenizer(str(folder)).fingerprint != first
