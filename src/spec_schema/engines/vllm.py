"""vLLM adapter: its speculative-decoding objects checked as views of the chain form, on both model runners.

```python
from spec_schema.engines import vllm as spec_vllm
view = spec_vllm.check(metadata, config)                    # SpecDecodeMetadata or MRv2 InputBatch -> ChainVerifyInput
out = spec_vllm.check(sampler_output, config, metadata)     # either SamplerOutput -> ChainVerifyOutput
spec_vllm.install()   # under SPEC_STRICT: the rejection samplers and the drafters' propose checked
```

vLLM drafts chains. V1's model runner builds `SpecDecodeMetadata` (flat drafts, a ragged per-request
count); Model Runner V2, vLLM's default, hands its rejection sampler an `InputBatch` instead. Each
rejection sampler returns a `SamplerOutput` of its own class. `check` presents any of the four as a
`ChainVerifyInput` / `ChainVerifyOutput` over vLLM's own tensors (never copies; fields MRv2 does not
carry are None and left out) and checks it with vLLM's index policy. Errors name both
vocabularies: `vllm SpecDecodeMetadata.cu_num_draft_tokens -> ChainVerifyInput.cu_num_drafts: ...`
(a `SpecContractError` whose `.field` is the contract's). The drafter's input hidden states are
checked against the width rule's extend width (`check_target_hidden`, `check_aux_hidden`).
Classes are recognised by module and name: vLLM is not imported here. What the installed vLLM
supports is probed (`probe`), not read from a version list. `spec_schema.engines.vllm_plugin` is
vLLM's `vllm.general_plugins` entry point: it installs the checks in every vLLM process.
"""

from ._vllm_check import CLASS_MAPS, check, view
from ._vllm_hidden import check_aux_hidden, check_target_hidden
from ._vllm_install import TARGETS, install, installed, probe, spec_config_from_vllm, uninstall

__all__ = ["CLASS_MAPS", "TARGETS", "check", "view", "check_target_hidden", "check_aux_hidden", "install",
           "installed", "uninstall", "probe", "spec_config_from_vllm"]
