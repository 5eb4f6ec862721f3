"""Server configuration (frozen; change per run with dataclasses.replace)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from realtime.protocol.frames import DEFAULT_MAX_FRAME


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allow_no_auth: bool = False  # explicit opt-out for non-loopback binds (behind an authenticating proxy)
    max_frame_bytes: int = DEFAULT_MAX_FRAME
    max_streams: int = 256
    generator_device: str = "cpu"
    codec_device: str = "cpu"
    dtype: str = "float32"
    tts_model: str | None = None  # None: the embedded Piper voice; a CSM checkpoint folder otherwise
    tts_slots: int = 16  # CSM: concurrent streams with a preallocated KV-cache slot
    cuda_graphs: bool = True  # CSM on CUDA: graph the frame step and the codec step (False: eager)
    asr_model: str | None = None  # None: embedded Whisper tiny.en (when enabled)
    text_model: str | None = None  # None: embedded SmolLM2 (when enabled)
    image_model: str | None = None
    video_model: str | None = None  # /v1/video: a checkpoint folder; a DiT folder runs frame by frame
    text_slots: int | None = None  # text decode: concurrent requests with a KV-cache slot (default per device)
    text_context: int | None = None  # text decode: tokens per slot
    text_exact: bool = False  # CPU text: every weight dequantized to float32 (else the GGUF's own 4-bit codes)
    asr_exact: bool = False  # CPU ASR: float32 throughout (else bf16 encoder products where the CPU has them)
    # CPU text: a new prompt reuses the K/V of a prefix another request left in a free slot (the
    # system prompt, a conversation's history; exact). Off for deployments whose users must not
    # share anything, timing included: a reused prefix answers sooner.
    text_prefix_reuse: bool = True
    enable_asr: bool = False
    enable_text: bool = False
    warmup: bool = True
    shutdown_timeout_s: float = 5.0

    def is_loopback(self) -> bool:
        if self.host in ("localhost", ""):
            return self.host == "localhost"
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def check_auth(self) -> None:
        from realtime.errors import ConfigError

        if self.api_key is None and not self.is_loopback() and not self.allow_no_auth:
            raise ConfigError(
                f"refusing to serve on {self.host} without authentication: set --api-key (or "
                "REALTIME_API_KEY), bind to 127.0.0.1, or pass --no-auth if a proxy authenticates")
