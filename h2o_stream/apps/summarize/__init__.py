"""Long-document summarization through a fixed-size cache: single-pass and hierarchical strategies.

summarize() is the entry point (api.py); documents.py reads what is summarized (through the one corpus reader,
`h2o_stream.loading.corpus`); prompts.py builds the prompt around a document; reader.py streams ids through caches
and decodes with `h2o_stream.generation`; strategies.py holds single and hierarchical; settings.py the defaults and
checks; results.py what comes back.
"""

from .api import resolve_model, summarize
from .documents import Document, as_document, list_books, load_document
from .prompts import Prompt, build_prompt, encode
from .results import SectionSummary, SummaryResult

__all__ = ["Document", "Prompt", "SectionSummary", "SummaryResult", "as_document", "build_prompt", "encode",
           "list_books", "load_document", "resolve_model", "summarize"]
