"""Hand-written parallel layouts (Megatron-LM style grids) expressed as autopar plans and scored by the same
cost model, so that autopar's own choice can be compared with them apples to apples."""
