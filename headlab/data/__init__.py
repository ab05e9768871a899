"""The data a run reads: texts and datasets (`texts`), token blocks and the scoring /
held-out split (`blocks`), the papers' calibration and evaluation sets (`protocol`), and
the bundled English text (``resources/english.txt``)."""
