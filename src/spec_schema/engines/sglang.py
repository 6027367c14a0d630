"""sglang 0.5.23 adapter: its speculative-decoding objects checked as views of the phase classes.

```python
from spec_schema.engines import sglang as spec_sglang
view = spec_sglang.check(obj, config, batch)   # a phase object over sglang's own tensors
spec_sglang.install(config)                    # under SPEC_STRICT: check every sglang boundary
```

In a server, sglang's plugin mechanism calls `install` in every engine process with a config built
from the engine's own models (`spec_schema.engines.sglang_plugin`).

`check` takes sglang's `EagleDraftInput`, `EagleVerifyInput`, `EagleDraftExtendInput` and the verify
result (`GenerationBatchResult`), reads the fields sglang keeps on its `ScheduleBatch` from `batch`
(the real one or any object with `seq_lens`, `req_pool_indices`, `input_ids`, `seq_lens_cpu`,
`seq_lens_sum`), presents them as a phase-class instance over views of sglang's tensors (never
copies) and checks that with sglang's index policy. Where sglang's layout is flat, the flat length
is checked before the view is taken. Errors name both vocabularies:
`sglang EagleVerifyInput.draft_token -> VerifyInput.draft_token: ...` (a `SpecContractError` whose
`.field` is the contract's field). How every field is found is data: `CLASS_MAPS`, which the views
are built from and docs/engines.md's tables are generated from.

Fields sglang does not carry on a path (the decode path's draft-extend positions, the verify
result's accept tokens) are listed as "not carried" and left out of that check; the check of the
fields present is not loosened. sglang is imported only by `install()`, never by `check`. What
`install` wraps is the table `BOUNDARIES` (probed on the installed sglang; `NOT_WRAPPED` lists the
boundaries left and why).
"""

from ._sglang_boundaries import BOUNDARIES, NOT_WRAPPED
from ._sglang_check import CLASS_MAPS, POLICIES, SUPPORTED_VERSIONS, check, check_merge_inputs, mark_resolved
from ._sglang_install import install, installed, uninstall

__all__ = ["SUPPORTED_VERSIONS", "CLASS_MAPS", "POLICIES", "BOUNDARIES", "NOT_WRAPPED", "check", "check_merge_inputs",
           "mark_resolved", "install", "uninstall", "installed"]
