"""Identities of one model as an engine library describes them: what differs (KV bits, chat
template, adapter, runtime) changes the hash it goes into, and the traits say it in words."""

from __future__ import annotations

from kvd_protocol.identity import Identity

MODEL = "llama-1489590bf7a7"


def variant(
    kv: str = "none",
    *,
    template: str = "1a2b3c4d",
    adapter: str = "none",
    runtime: str = "mlx-0.29.1/cpu:x86_64",
    namespace: str = "",
    model: str = MODEL,
    traits: bool = True,
    source: str = "",
) -> Identity:
    """The identity model_folder.folder_identity would give (traits False: an engine that
    says none, as one that predates them; source: where the model came from, if said)."""
    adapter_space = "" if adapter == "none" else f"adapter-{adapter}"
    return Identity(
        model_id=model,
        config_fingerprint=f"cfg-{kv}-0123456789",
        tokenizer_hash=f"tok-{template}-0123456789",
        codec_id="kvd-codecs/3",
        runtime=runtime,
        namespace="/".join(part for part in (adapter_space, namespace) if part),
        traits=(
            f"kv={kv},template={template},adapter={adapter}"
            + (f",source={source}" if source else "")
            if traits
            else ""
        ),
    )
