"""Images in, text out: loading images from every source a row can name (:mod:`.images`), turning a prompt and
its images into the engine's inputs with the checkpoint's own processor (:mod:`.inputs`), and chat messages with
image parts (:mod:`.chat`). Needs the ``vision`` extra (Pillow); text-only use never imports it."""
