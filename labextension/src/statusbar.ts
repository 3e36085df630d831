/**
 * The status bar item: suspended kernels and GPU memory freed.
 */
import { Widget } from '@lumino/widgets';

import { formatBytes } from './format';
import { CedanaModel } from './model';

/** The status bar text for the model's summary. */
export function statusText(model: CedanaModel): string {
  const summary = model.summary;
  const kernels = summary.suspended === 1 ? 'kernel' : 'kernels';
  let text = `${summary.suspended} ${kernels} suspended`;
  if (summary.gpuMemoryFreed > 0) {
    text += ` · ${formatBytes(summary.gpuMemoryFreed)} GPU freed`;
  }
  return text;
}

export class CedanaStatusItem extends Widget {
  constructor(model: CedanaModel, onClick?: () => void) {
    super();
    this._model = model;
    this.addClass('jp-cedana-status-item');
    this.node.title = 'Suspended kernels (click to open the panel)';
    if (onClick) {
      this.node.addEventListener('click', onClick);
      this.node.style.cursor = 'pointer';
    }
    model.changed.connect(this._render, this);
    this._render();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._model.changed.disconnect(this._render, this);
    super.dispose();
  }

  private _render(): void {
    const text = statusText(this._model);
    if (this.node.textContent !== text) {
      this.node.textContent = text;
    }
  }

  private _model: CedanaModel;
}
