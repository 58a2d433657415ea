"""ServeSettings: every server knob in one validated object, built at the CLI edge."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantkit.engine.config import EngineConfig
from quantkit.errors import QuantkitError


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
