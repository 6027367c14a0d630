"""The kernels that took over the graphs' torch bookkeeping build for sm90 without a GPU (the
interpreter type-checks less than the compiler: a runtime branch's types, constexpr paths it never
takes), in one subprocess; what they compute is checked against their references in their own tests."""

from kernel_helpers import hopper_builds


def _ptrs(names: str, kind: str) -> dict[str, str]:
    return {name: kind for name in names.split()}


def test_bookkeeping_kernels_build_for_hopper() -> None:
    jobs = [
        dict(module="spec_kernels.accept", name="_verify_greedy_kernel",
             types={**_ptrs("cand_ptr ri_ptr nt_ptr ns_ptr tp_ptr predicts_ptr accept_ptr tokens_ptr stacked_ptr",
                            "*i64"), "num_correct_ptr": "*i32"},
             constexprs=[dict(WP=8, PREDICTS=True, TOKENS=False, STACKED=False),
                         dict(WP=8, PREDICTS=False, TOKENS=True, STACKED=True)]),
        dict(module="spec_kernels.extend_rows", name="_extend_rows_kernel",
             types={**_ptrs("slots_ptr prefix_ptr last_ptr extra_ptr", "*i64"), **_ptrs("counts_ptr seq_ptr", "*i32")},
             constexprs=[dict(SP=8)]),
        dict(module="spec_kernels.tree_rows", name="_pad_tree_rows_kernel",
             types={**_ptrs("tok_ptr pos_ptr ri_ptr nt_ptr ns_ptr seq_ptr req_ptr d_tok_ptr d_pos_ptr d_ri_ptr "
                            "d_nt_ptr d_ns_ptr d_seq_ptr d_req_ptr nlive_ptr", "*i64"),
                    **_ptrs("mask_ptr d_mask_ptr", "*u8")},
             constexprs=[dict(NP=8)]),
        dict(module="spec_kernels.frontier", name="_chain_probs_kernel",
             types={"root_ptr": "*fp32", "tok_ptr": "*i64", "out_ptr": "*fp32"}, constexprs=[dict(BLOCK=1024)]),
        dict(module="spec_kernels.frontier", name="_onehot_kernel",
             types={"ids_ptr": "*i64", "ones_ptr": "*fp32", "out_ptr": "*fp32"}, constexprs=[dict(BLOCK=1024)]),
        dict(module="spec_kernels.frontier", name="_frontier_kernel",
             types={**_ptrs("scores_ptr p_ptr rec_scores_ptr new_scores_ptr", "*fp32"),
                    **_ptrs("ids_ptr d2t_ptr slots_in_ptr temp_ptr seq_ptr rec_tokens_ptr plist_ptr new_tokens_ptr "
                            "parent_ptr slots_out_ptr out_slots_ptr positions_ptr", "*i64"),
                    **_ptrs("h_in_ptr h_out_ptr", "*bf16")},
             constexprs=[dict(K=4, NC=16, NCP=16, STEP=1, SP=2, HAS_D2T=True, HAS_NEXT=True, HIDDEN=True,
                              BLOCK_H=1024)]),
        dict(module="spec_kernels.topk", name="_topk_merge_kernel",
             types={**_ptrs("pm_ptr ps_ptr pv_ptr val_ptr", "*fp32"), "pi_ptr": "*i32", "idx_ptr": "*i64",
                    "d2t_ptr": "*i64"},
             constexprs=[dict(K=4, KP=4, CP=32, SOFTMAX=True, D2T=True)]),
    ]
    irs = hopper_builds(jobs)
    assert len(irs) == 8 and all("tt.store" in ir for ir in irs)
