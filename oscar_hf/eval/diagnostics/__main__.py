from oscar_hf.eval.diagnostics.cli import main

raise SystemExit(main())
