"""The pipeline kit: a lazy module proxy that loads a component on first use, the release schedule that
frees it after its last use, and ``apply_offload_config``, which applies a resolved offload config to a
model's components. It decides nothing about devices (that is ``fastoffload_ext.policy``) and moves no
weights itself (that is ``fastoffload_ext.engine``).
"""
