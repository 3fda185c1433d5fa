from inference_fabric_client.cli import main

raise SystemExit(main())
