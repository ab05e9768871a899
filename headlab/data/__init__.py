"""The data a run reads: texts and datasets (`texts`), token blocks and the scoring /
held-out split (`blocks`), the papers' calibration and evaluation sets (`protocol`),
tokens and prompts given as text (`tokens`), and the bundled English text
(``resources/english.txt``)."""
