/**
 * The notebook toolbar item that says when the notebook's kernel is
 * suspended, and shows "Resuming… (size)" with progress while it resumes.
 */
import { ISessionContext } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { formatBytes } from './format';
import { CedanaModel } from './model';
import { IKernel } from './types';

/** The text, tooltip and progress the indicator shows for a kernel. */
export interface IIndicatorView {
  text: string;
  title: string;
  /** 0..1, or null for none. */
  fraction: number | null;
  state: string;
}

/** What the indicator shows; null when there is nothing to say. */
export function indicatorView(
  kernel: IKernel | undefined,
  model?: CedanaModel
): IIndicatorView | null {
  if (!kernel) {
    return null;
  }
  const progress = kernel.progress;
  const fraction =
    progress && typeof progress.fraction === 'number'
      ? Math.min(1, Math.max(0, progress.fraction))
      : null;
  const percent = fraction === null ? '' : ` ${Math.round(fraction * 100)} %`;
  const size =
    kernel.checkpoint_bytes > 0
      ? kernel.checkpoint_bytes
      : (progress?.bytes_total ?? 0);
  switch (kernel.state) {
    case 'suspended': {
      if (kernel.queued?.action === 'resume') {
        return {
          text: 'Resuming… (queued)',
          title: `Waiting for a free resume slot (#${kernel.queued.position} in line): other kernels are resuming`,
          fraction: null,
          state: 'resuming'
        };
      }
      const freed = model ? model.gpuMemoryFreed(kernel) : 0;
      const parts = [
        `Kernel suspended${kernel.tier ? ` (${kernel.tier})` : ''}`,
        size > 0 ? `checkpoint ${formatBytes(size)}` : '',
        freed > 0 ? `${formatBytes(freed)} GPU memory freed` : '',
        'run a cell to resume it'
      ].filter(Boolean);
      return {
        text: 'Suspended',
        title: parts.join('; '),
        fraction: null,
        state: 'suspended'
      };
    }
    case 'resuming':
      return {
        text: `Resuming…${size > 0 ? ` (${formatBytes(size)})` : ''}${percent}`,
        title: progress
          ? `Resuming the kernel: ${progress.phase}`
          : 'Resuming the kernel',
        fraction,
        state: 'resuming'
      };
    case 'suspending':
      return {
        text: `Suspending…${percent}`,
        title: progress
          ? `Checkpointing the kernel: ${progress.phase}`
          : 'Checkpointing the kernel',
        fraction,
        state: 'suspending'
      };
    case 'failed':
      return {
        text: 'Suspend/resume failed',
        title: kernel.reason ?? 'The last suspend or resume failed',
        fraction: null,
        state: 'failed'
      };
    default:
      return null;
  }
}

/**
 * A toolbar item bound to one notebook's session.
 */
export class KernelSuspendIndicator extends Widget {
  constructor(model: CedanaModel, sessionContext: ISessionContext) {
    super();
    this._model = model;
    this._sessionContext = sessionContext;
    this.addClass('jp-cedana-indicator');
    this._label = document.createElement('span');
    this._label.className = 'jp-cedana-indicator-label';
    this._bar = document.createElement('span');
    this._bar.className = 'jp-cedana-indicator-bar';
    this._fill = document.createElement('span');
    this._fill.className = 'jp-cedana-indicator-fill';
    this._bar.appendChild(this._fill);
    this.node.appendChild(this._label);
    this.node.appendChild(this._bar);
    model.changed.connect(this._render, this);
    sessionContext.kernelChanged.connect(this._render, this);
    sessionContext.sessionChanged.connect(this._render, this);
    this._render();
  }

  /** The id of the notebook's kernel, or null. */
  get kernelId(): string | null {
    return this._sessionContext.session?.kernel?.id ?? null;
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._model.changed.disconnect(this._render, this);
    this._sessionContext.kernelChanged.disconnect(this._render, this);
    this._sessionContext.sessionChanged.disconnect(this._render, this);
    super.dispose();
  }

  private _render(): void {
    if (this.isDisposed) {
      return;
    }
    const id = this.kernelId;
    const view = indicatorView(
      id ? this._model.get(id) : undefined,
      this._model
    );
    if (!view) {
      this.addClass('jp-mod-hidden');
      this.node.dataset.state = 'running';
      this._label.textContent = '';
      this.node.title = '';
      return;
    }
    this.removeClass('jp-mod-hidden');
    this.node.dataset.state = view.state;
    this._label.textContent = view.text;
    this.node.title = view.title;
    if (view.fraction === null) {
      this._bar.style.display = 'none';
    } else {
      this._bar.style.display = '';
      this._fill.style.width = `${Math.round(view.fraction * 100)}%`;
    }
  }

  private _model: CedanaModel;
  private _sessionContext: ISessionContext;
  private _label: HTMLSpanElement;
  private _bar: HTMLSpanElement;
  private _fill: HTMLSpanElement;
}
