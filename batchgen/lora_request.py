"""``batchgen.LoRARequest``: which LoRA adapter a request runs under (vLLM's class and field names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) to apply to one
    request. ``lora_int_id`` (>= 1) identifies the adapter inside the engine: requests with the same id share
    one resident copy and their cached prefixes; two different adapters must have different ids.

    >>> LoRARequest("sql", 1, "/adapters/sql-lora")
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name must be a non-empty string")
        object.__setattr__(self, "lora_path", str(self.lora_path))
