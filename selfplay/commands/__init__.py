"""The commands of `selfplay`, a module per group: ``data`` (generate, convert), ``train`` (train,
sft), ``loop`` (iterate, and how a recipe becomes its options), ``results`` (eval, report,
compare); ``common`` holds what they share (the error line, the engine options, the default
folder). Each is a plain function with its options; ``selfplay.cli`` registers them on the app.
"""
