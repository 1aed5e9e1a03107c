"""Long-document summarization through a fixed-size cache: single-pass and hierarchical strategies.

summarize() is the entry point (api.py); documents.py reads what is summarized (through the one corpus reader,
`h2o_stream.loading.corpus`); prompts.py builds the prompt around a document; reader.py streams ids through caches
and decodes with `h2o_stream.generation`; strategies.py holds single and hierarchical; settings.py the defaults and
checks; results.py what comes back. The names below are imported on first use (`h2o_stream.lazy`).
"""

from h2o_stream.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".api": ("resolve_model", "summarize"),
        ".documents": ("Document", "as_document", "list_books", "load_document"),
        ".prompts": ("Prompt", "build_prompt", "encode"),
        ".results": ("SectionSummary", "SummaryResult"),
    },
)
