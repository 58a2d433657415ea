"""ServeSettings: every server knob in one validated object, built at the CLI edge."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from quantkit.engine.config import EngineConfig
from quantkit.engine.pooling import DEFAULT_POOLING, POOLING_METHODS
from quantkit.errors import QuantkitError

ANY = ("*",)  # vLLM's CORS defaults: every origin, method and header


@dataclass(slots=True)
class ServeSettings:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()  # empty: the model argument as given
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    api_keys_file: Path | None = None  # named keys with per-key limits (TOML; see quantkit.serve.keyring)
    chat_template: str | None = None  # the template's text (read from --chat-template FILE)
    max_queued_requests: int | None = None  # None: unbounded, as vLLM
    shutdown_timeout: float = 30.0  # seconds requests in flight may take to finish on SIGTERM
    log_level: str = "info"
    pooling: str = DEFAULT_POOLING  # /v1/embeddings: the final hidden state of the "last" token, or the "mean"
    seed: int | None = None  # the seed of requests that give none (each such request samples as if it gave it)
    # CORS (vLLM's flags and defaults): a browser page on another origin may call the API
    allowed_origins: tuple[str, ...] = ANY
    allowed_methods: tuple[str, ...] = ANY
    allowed_headers: tuple[str, ...] = ANY
    allow_credentials: bool = False
    root_path: str = ""  # the path prefix a proxy serves this server under (it strips it before forwarding)
    uds: Path | None = None  # listen on this Unix socket instead of host:port
    enable_auto_tool_choice: bool = False  # tool_choice "auto" parses the output with tool_call_parser (vLLM's flags)
    tool_call_parser: str | None = None  # a name of quantkit.serve.tool_calls.FORMATS

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise QuantkitError(f"--port must be in 0..65535 (got {self.port})")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise QuantkitError(f"--max-queued-requests must be at least 1 (got {self.max_queued_requests})")
        if self.shutdown_timeout < 0:
            raise QuantkitError(f"--shutdown-timeout must be >= 0 seconds (got {self.shutdown_timeout})")
        if any(not k for k in self.api_keys):
            raise QuantkitError("--api-key must not be empty")
        if self.tool_call_parser is not None and self.tool_call_parser not in tool_call_formats():
            raise QuantkitError(f"--tool-call-parser {self.tool_call_parser!r}: expected one of "
                                f"{', '.join(tool_call_formats())}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise QuantkitError("--enable-auto-tool-choice needs --tool-call-parser (which format the model writes "
                                "calls in)")
        if not self.served_model_names:
            self.served_model_names = (self.engine.model,)
        if self.seed is not None:  # vLLM's --seed seeds the engine too
            self.engine.seed = self.seed
        if self.pooling not in POOLING_METHODS:
            raise QuantkitError(f"--pooling {self.pooling!r}: expected one of {', '.join(POOLING_METHODS)}")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise QuantkitError(f"--root-path {self.root_path!r}: a path that starts with / and does not end with "
                                "one, such as /llm")

    def url(self, path: str = "") -> str:
        """Where a client on this machine reaches `path` (a proxy adds --root-path in front; this server answers
        without it)."""
        if self.uds is not None:
            return f"http://localhost{path} on the Unix socket {self.uds}"
        return f"http://{self.host}:{self.port}{path}"

    def default_seed(self, params):
        """`params` (SamplingParams) with the server's --seed where the request gave no seed."""
        if self.seed is None or params.seed is not None:
            return params
        return dataclasses.replace(params, seed=self.seed)

    def key_ring(self):
        """The keys of --api-key and --api-keys-file (read now: a bad file is a one-line error at start-up)."""
        from quantkit.serve.keyring import KeyRing, load_keys_file, plain_keys

        keys = plain_keys(self.api_keys)
        if self.api_keys_file is not None:
            keys += load_keys_file(self.api_keys_file)
        return KeyRing(keys)

    @property
    def model_name(self) -> str:
        """The first served name: what responses report, and what an omitted `model` means."""
        return self.served_model_names[0]


def json_list(text: str | None, flag: str) -> tuple[str, ...] | None:
    """A flag's JSON list of strings, as vLLM takes --allowed-origins (None when not given); a one-line error."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise QuantkitError(f"{flag}: not JSON ({exc.msg} at char {exc.pos}); expected a list such as "
                            '\'["https://example.com"]\'') from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise QuantkitError(f"{flag}: expected a JSON list of strings")
    return tuple(value)


def tool_call_formats() -> tuple[str, ...]:
    from quantkit.serve.tool_calls import FORMATS

    return tuple(FORMATS)


def read_chat_template(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise QuantkitError(f"--chat-template {path}: cannot read it ({exc})") from exc
