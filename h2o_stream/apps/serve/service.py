"""The server without HTTP: the model, the store, the conversations and the worker, and how a checked OpenAI
request becomes a turn. `app.create_app` puts HTTP in front of it; tests and benchmarks may use either."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from h2o_stream.apps.chat import DEFAULT_CACHE_SIZE, DEFAULT_CHUNK_SIZE, ChatSession, chat_sampling
from h2o_stream.apps.chat.session_file import model_fingerprint, policy_from_settings
from h2o_stream.engine.policies import make_policy
from h2o_stream.errors import H2OStreamError

from .batching import BatchedModel
from .conversations import Conversations
from .history import parse_history
from .keys import Keys
from .limits import DEFAULT_IN_MEMORY, DEFAULT_MAX_BATCH
from .protocol import ApiError, ChatRequest, Limits, PromptLimit, TextRequest, reply_limit, stop_texts, unknown_model
from .store import CONVERSATION_ID, Bounds, Store
from .worker import TextTurn, TurnRequest, Worker

log = logging.getLogger("h2o_stream.serve")


@dataclass
class ServeSettings:
    """How the server runs: where conversations live, how many stay in memory, the cache of a new conversation
    (`policy` name, `cache_size`, budget `parts`), the request limits, the API keys (none: no key needed) and what
    the state directory may keep."""

    state_dir: Path
    served_model: str
    policy: str = "h2o"
    cache_size: int | None = DEFAULT_CACHE_SIZE
    parts: dict = field(default_factory=dict)
    rolling: bool = True
    chunk_size: int = DEFAULT_CHUNK_SIZE
    in_memory: int = DEFAULT_IN_MEMORY
    max_batch: int = DEFAULT_MAX_BATCH  # turns under way at once: the rows of a batched forward
    max_queue: int = 256
    default_max_tokens: int = 256  # a reply's length when the request gives none
    api_keys: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)
    allow_request_settings: bool = False  # may a request choose its new conversation's policy and cache size
    batch: bool = True  # the forwards of the turns under way run as the rows of one batch
    bounds: Bounds = field(default_factory=Bounds)


class Service:
    """One model serving conversations (see the package docstring). `start()` takes the state directory and starts
    the model worker; `stop()` cancels what is under way (each conversation stays at its last completed turn)."""

    def __init__(self, model, tokenizer, settings: ServeSettings, *, model_name: str | None = None):
        for name in ("in_memory", "max_batch"):
            if getattr(settings, name) < 1:
                raise H2OStreamError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(settings, name)}")
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self._batched = BatchedModel(model)  # what sessions call: their forwards join the worker's batch
        self.model_name = model_name or settings.served_model
        self.default_policy = self._policy(settings.policy, settings.cache_size, settings.parts).settings()
        # part of every history's digest: a conversation saved with another model is another conversation (its
        # files stay as they are, for when that model is served again)
        self._model_key = {k: v for k, v in model_fingerprint(model).items() if k != "name"}
        self.store = Store(settings.state_dir)
        config = model.config.get_text_config(decoder=True)
        self.limit = PromptLimit(settings.limits.max_prompt_tokens, getattr(config, "max_position_embeddings", None))
        self.keys = Keys(settings.api_keys)
        self.worker: Worker | None = None

    def start(self) -> list[str]:
        """Take the state directory and start serving (once; again is a no-op); notices about what was found
        there."""
        if self.worker is not None:
            return []
        notices = self.store.open()
        conversations = Conversations(self.store, self._session, self.settings.in_memory, self.settings.bounds)
        if removed := conversations.trim():
            notices.append(f"removed {removed} conversation(s) unused for too long or beyond the disk bounds")
        self.worker = Worker(
            conversations,
            self.model,
            max_jobs=self.settings.max_queue,
            max_batch=self.settings.max_batch,
            batch=self.settings.batch,
        )
        self.worker.start()
        for notice in notices:
            log.warning(notice)
        return notices

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
        self.store.close()

    @property
    def policy_text(self) -> str:
        """The cache of a new conversation, for people."""
        return policy_from_settings(self.default_policy).describe() + ("" if self.settings.rolling else ", no rolling")

    def _policy(self, name: str, size: int | None, parts: dict):
        return make_policy(name, None if name == "full" else size, tokenizer=self.tokenizer, **parts)

    def _session(self, system: str | None, policy: dict) -> ChatSession:
        return ChatSession(
            self._batched,
            self.tokenizer,
            policy=policy_from_settings(policy),
            rolling=self.settings.rolling,
            system=system,
            sampling=chat_sampling(),
            chunk_size=self.settings.chunk_size,
            model_name=self.model_name,
        )

    def turn_request(self, request: ChatRequest, conversation: str | None, owner: str = "") -> TurnRequest:
        """The turn a checked request of `owner` (`keys.owner`) asks for; ApiError for what only the server can
        judge (the model's name, the conversation id, a per-request cache)."""
        self._check_model(request)
        if conversation is not None and not CONVERSATION_ID.fullmatch(conversation):
            raise ApiError(
                400, "X-Conversation-Id must be 1 to 64 letters, digits, '-' or '_'", param="X-Conversation-Id"
            )
        policy = self.default_policy
        if (request.policy is not None or request.cache_size is not None) and not self.settings.allow_request_settings:
            given = "policy" if request.policy is not None else "cache_size"
            raise ApiError(
                400,
                f"this server chooses the cache itself ({self.policy_text}): remove {given} from the request (its "
                "operator may allow it: h2o-stream serve --allow-request-settings)",
                param=given,
                code="setting_not_allowed",
            )
        if request.policy is not None or request.cache_size is not None:
            name = request.policy or self.settings.policy
            parts = self.settings.parts if name == self.settings.policy else {}
            try:
                policy = self._policy(name, request.cache_size or self.settings.cache_size, parts).settings()
            except H2OStreamError as error:
                raise ApiError(400, f"policy/cache_size: {error}", param="policy") from None
        history = parse_history(
            request.messages, {"policy": policy, "rolling": self.settings.rolling, "model": self._model_key}
        )
        sampling = self._sampling(request)
        return TurnRequest(
            history, conversation, policy, sampling, self.limit, request.seed, stop_texts(request), owner
        )

    def text_request(self, request: TextRequest) -> TextTurn:
        """The text completion a checked request asks for, in a cache of the server's policy."""
        self._check_model(request)
        return TextTurn(
            request.text,
            self.default_policy,
            self._sampling(request),
            self.limit,
            request.seed,
            stop_texts(request),
            request.echo,
        )

    def _check_model(self, request) -> None:
        if request.model != self.settings.served_model:
            raise unknown_model(request.model, self.settings.served_model)

    def _sampling(self, request) -> dict:
        return {
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "repetition_penalty": request.repetition_penalty,
            "max_new_tokens": reply_limit(request) or self.settings.default_max_tokens,
        }


def api_key_from_env(given: str | None) -> str | None:
    """--api-key, else $H2O_STREAM_API_KEY, else None (no key needed); an empty key is no key."""
    key = given if given is not None else os.environ.get("H2O_STREAM_API_KEY")
    return key or None
