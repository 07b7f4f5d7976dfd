"""Views of a Plan for people: text, timeline and picture. They read a Plan's fields and the IR's
vocabulary and import nothing above the IR, so ``Plan.summary()`` can call them from the data layer.

    report              plan_summary           ``plan.summary()``: time, memory, layouts, collectives per stage
    trace               simulate_plan, write_chrome_trace   the pipeline schedule as a timeline / Chrome trace
    visualize           plan_to_html, write_html            the self-contained HTML report (``autopar report``)
    visualize_groups    group_ops, ...         grouping ops and parameters for display
    visualize_svg       mesh_svg, ...          the report's inline SVG pictures
    visualize_template  page, legend_html      the page around them (CSS, JS, legend)
"""
