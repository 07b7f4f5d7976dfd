"""The planner's orchestration: the passes (``autopar.passes``) run in order, priced by ``autopar.cost_models``,
and their answer assembled into a ``Plan``. It imports the passes, the cost models and the data below them;
only the public API (``autopar.api``), the baselines and the tools above them import it.

    driver         plan_model, plan_graph    the pipeline, one line per pass (its table of contents)
    options        PlanOptions               the planner's options, checked before any planning
    plan_builder   assemble_plan             solved stages -> Plan (specs, collectives, ranks, predictions)
    exact_checks   or_single_stage, ...      exact re-solves where the stage DP's scaled prices are furthest off
    manual_stages  manual_stages             a user's stage list as the stage DP's StageChoice
    invariants     (one per pass)            what each pass promises, checked with PlanOptions(debug=True)
"""
