"""The vLLM worker's "served_as" request (vllm_worker.py), in vLLM's environment beside it: how this vLLM reads a
draft folder holding a given config.json, asked before an export's engine starts (formats/versions.py's refusal of a
draft model vLLM would serve as its family's MTP layer). vLLM applies its speculative config's
`SpeculativeConfig.hf_config_override` to every draft config but Medusa's, whatever the method.
"""

import json
import os
import tempfile


def served_as(request):
    """The config's architectures as `get_config` reads them ("written") and as a draft's config is served
    ("served"), or the override's error line ("error"); None where this release has no such function or cannot read
    the config."""
    try:
        from vllm.config.speculative import SpeculativeConfig
        from vllm.transformers_utils.config import get_config

        override = SpeculativeConfig.hf_config_override
    except (ImportError, AttributeError):
        return {"read": None}
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "config.json"), "w") as file:
            json.dump(request["config"], file)
        try:
            config = get_config(folder, trust_remote_code=False)
        except Exception:  # noqa: BLE001 - a config this release cannot read: it cannot tell
            return {"read": None}
    read = {"written": list(config.architectures or [])}
    try:
        read["served"] = list(override(config).architectures or [])
    except Exception as err:  # noqa: BLE001 - its line is the refusal's cause
        read["error"] = f"{type(err).__name__}: {err}"
    return {"read": read}
