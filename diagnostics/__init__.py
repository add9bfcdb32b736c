"""Hardware diagnostics: checks that prove, on a given machine, what a backend assumes.

    >>> from diagnostics import cu_free_check
    >>> for r in cu_free_check.standard_checks(torch.device("cuda", 0)): print(r)
"""
